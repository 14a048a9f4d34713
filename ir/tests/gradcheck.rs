//! Every gradient rule checked against central finite differences, and proof that the check can
//! fail.
//!
//! - The op set: `every_op_kind` holds one example of every `Op` variant, from a `match` without a
//!   wildcard, so a new variant does not compile until it is listed there; `plan` (also without a
//!   wildcard) gives each kind either the break of its rule or the reason it has no rule. A kind
//!   with a rule must have a case in `all_cases`, a kind without one a case in `no_rule_cases`
//!   (which checks that autodiff indeed never applies or refuses a rule there).
//! - The check: each case is one op applied to seeded random inputs; the checked scalar is
//!   `Σ_k sum(output_k * r_k)` with fixed random weights `r_k`, so every output element matters
//!   with a distinct weight.
//! - The proof: `a_broken_rule_is_caught` stands a wrong rule in for one rule at a time (through
//!   `GradOptions::replace_rule`, on the node under test only) and requires a numeric mismatch in
//!   that rule's own cases. Each break is a bug a rule could really have (a dropped sign, term or
//!   factor, a wrong operand, a permutation not inverted); only layout-like rules whose only
//!   well-typed mistake is a sign or a scale use a sign flip. An error, a panic or a wrong type is
//!   not a catch, and a break that changes nothing is reported as not caught
//!   (`a_no_op_break_is_not_caught`, `an_error_is_not_a_catch`).

use graphtrain_ir::autodiff::{grad_with, AutodiffError, GradOptions, RuleHook, RuleSite};
use graphtrain_ir::interp::{run, HostTensor};
use graphtrain_ir::{
    rng, verify, BinaryOp, CompareOp, DType, Graph, InputKind, Meta, Op, RopeLayout, TensorType,
    TypeError, UnaryOp, ValueId,
};
use std::cell::Cell;
use std::collections::BTreeSet;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

const F: DType = DType::F64;

// ---------------------------------------------------------------------------------------------
// The op set and what gradcheck does with each kind

/// Lists every `Op` variant once, as a pattern and the example ops of that kind. The generated
/// `match` has no wildcard: a new variant does not compile until it is listed here.
macro_rules! op_kinds {
    ($($pat:pat => $examples:expr),* $(,)?) => {
        /// One op of every kind (every unary, binary and compare op separately; attributes are
        /// placeholders).
        fn every_op_kind() -> Vec<Op> {
            #[allow(dead_code)]
            fn exhaustive(op: &Op) {
                match op {
                    $($pat => {})*
                }
            }
            let mut ops: Vec<Op> = Vec::new();
            $(
                for op in $examples {
                    assert!(matches!(op, $pat), "{op:?} listed under the wrong pattern");
                    ops.push(op);
                }
            )*
            ops
        }
    };
}

op_kinds! {
    Op::Unary(_) => UnaryOp::ALL.map(Op::Unary),
    Op::Binary(_) => BinaryOp::ALL.map(Op::Binary),
    Op::Compare(_) => CompareOp::ALL.map(Op::Compare),
    Op::Select => [Op::Select],
    Op::AddScalar { .. } => [Op::AddScalar { value: 0.0 }],
    Op::MulScalar { .. } => [Op::MulScalar { value: 0.0 }],
    Op::PowScalar { .. } => [Op::PowScalar { exponent: 0.0 }],
    Op::Cast { .. } => [Op::Cast { dtype: F }],
    Op::Offload => [Op::Offload],
    Op::Reload => [Op::Reload],
    Op::ReduceSum { .. } => [Op::ReduceSum { axes: vec![], keepdim: false }],
    Op::ReduceMax { .. } => [Op::ReduceMax { axes: vec![], keepdim: false }],
    Op::Reshape { .. } => [Op::Reshape { shape: vec![] }],
    Op::Transpose { .. } => [Op::Transpose { perm: vec![] }],
    Op::Expand { .. } => [Op::Expand { shape: vec![] }],
    Op::Slice { .. } => [Op::Slice { axis: 0, start: 0, end: 0 }],
    Op::Concat { .. } => [Op::Concat { axis: 0 }],
    Op::Gather { .. } => [Op::Gather { axis: 0 }],
    Op::ScatterAdd { .. } => [Op::ScatterAdd { axis: 0 }],
    Op::Matmul => [Op::Matmul],
    Op::Full { .. } => [Op::Full { value: 0.0, shape: vec![], dtype: F }],
    Op::Iota { .. } => [Op::Iota { shape: vec![], axis: 0, dtype: F }],
    Op::RandomUniform { .. } => [Op::RandomUniform { shape: vec![], dtype: F, stream: 0 }],
    Op::RandomNormal { .. } => [Op::RandomNormal { shape: vec![], dtype: F, stream: 0 }],
    Op::Embedding => [Op::Embedding],
    Op::EmbeddingBackward { .. } => [Op::EmbeddingBackward { rows: 0 }],
    Op::RmsNorm { .. } => [Op::RmsNorm { eps: 0.0 }],
    Op::RmsNormBackward { .. } => [Op::RmsNormBackward { eps: 0.0 }],
    Op::Rope { .. } => [Op::Rope { theta: 0.0, layout: RopeLayout::Half, inverse: false }],
    Op::Attention { .. } => [Op::Attention { causal: false, scale: 0.0, stats: false }],
    Op::AttentionBackward { .. } => [Op::AttentionBackward { causal: false, scale: 0.0, stats: false }],
    Op::Softmax { .. } => [Op::Softmax { axis: 0 }],
    Op::LogSoftmax { .. } => [Op::LogSoftmax { axis: 0 }],
    Op::CrossEntropy => [Op::CrossEntropy],
    Op::CrossEntropyBackward => [Op::CrossEntropyBackward],
    Op::AdamW { .. } => [Op::AdamW { beta1: 0.0, beta2: 0.0, eps: 0.0, weight_decay: 0.0 }],
    Op::Sgd { .. } => [Op::Sgd { weight_decay: 0.0 }],
    Op::CollectiveStart { .. } => {
        use graphtrain_ir::{Collective::*, Reduce::Sum};
        [
            AllGather { axis: 0 },
            ReduceScatter { axis: 0, reduce: Sum },
            AllReduce { reduce: Sum },
            AllToAll { split_axis: 0, concat_axis: 0 },
            Broadcast { root: 0 },
        ]
        .map(|collective| Op::CollectiveStart { collective, mesh_dims: vec![0], group: 1 })
    },
    Op::Wait => [Op::Wait],
    Op::ToPartial { .. } => [Op::ToPartial { mesh_dims: vec![0], group: 1 }],
}

type Cots = Vec<Option<ValueId>>;
type R = Result<ValueId, TypeError>;

/// A wrong version of a rule: from the rule's input cotangents `c` (and the node), the ones the
/// bug would have produced.
type BreakFn = fn(&mut Bld<'_>, &RuleSite<'_>, Cots) -> Result<Cots, TypeError>;

#[derive(Clone, Copy)]
struct Break {
    what: &'static str,
    apply: BreakFn,
}

enum Plan {
    /// The op has a gradient rule, checked by its cases; the break stands in for it in the
    /// sensitivity test.
    Rule(Break),
    /// The op has no gradient rule, for this reason.
    NoRule(&'static str),
    /// The op combines ranks: its rule is checked on the N-rank interpreter, against finite
    /// differences of all ranks together (`tests/spmd.rs`).
    OnRanks,
}

fn brk(what: &'static str, apply: BreakFn) -> Plan {
    Plan::Rule(Break { what, apply })
}

/// The output cotangent, the forward input `k` and the forward output of the node under test.
fn gy(s: &RuleSite<'_>) -> ValueId {
    s.out_cots[0].expect("the node under test has an output cotangent")
}
fn input(s: &RuleSite<'_>, k: usize) -> ValueId {
    s.node.inputs[k]
}
fn output(s: &RuleSite<'_>) -> ValueId {
    s.node.outputs[0]
}

/// Negates every cotangent: for rules where no realistic bug type-checks (see each use).
fn sign_flip(b: &mut Bld<'_>, _: &RuleSite<'_>, c: Cots) -> Result<Cots, TypeError> {
    c.into_iter()
        .map(|c| c.map(|v| b.neg(v)).transpose())
        .collect()
}

const SIGN_FLIP: &str = "sign flip (identity-like layout rule: any other mistake is a type error)";

/// What gradcheck does with each op kind: the break of its rule, or why it has none. No wildcard:
/// a new variant does not compile until it is placed here.
fn plan(op: &Op) -> Plan {
    match op {
        Op::Unary(u) => match u {
            UnaryOp::Neg => brk("the minus dropped: dx = g", |_, s, _| Ok(vec![Some(gy(s))])),
            UnaryOp::Exp => brk("the input for the output: dx = g x", |b, s, _| {
                Ok(vec![Some(b.mul(gy(s), input(s, 0))?)])
            }),
            UnaryOp::Log => brk("multiplied instead of divided: dx = g x", |b, s, _| {
                Ok(vec![Some(b.mul(gy(s), input(s, 0))?)])
            }),
            UnaryOp::Sqrt => brk("the 1/2 dropped: dx = g / y", |b, s, _| {
                Ok(vec![Some(b.bin(BinaryOp::Div, gy(s), output(s))?)])
            }),
            UnaryOp::Rsqrt => brk("the minus dropped: dx = g y³/2", |b, s, _| {
                let y3 = b.op(Op::PowScalar { exponent: 3.0 }, vec![output(s)])?;
                let d = b.mul_scalar(y3, 0.5)?;
                Ok(vec![Some(b.mul(gy(s), d)?)])
            }),
            UnaryOp::Recip => brk("the minus dropped: dx = g y²", |b, s, _| {
                let y2 = b.un(UnaryOp::Square, output(s))?;
                Ok(vec![Some(b.mul(gy(s), y2)?)])
            }),
            UnaryOp::Sin => brk(
                "cos of the output, not the input: dx = g cos y",
                |b, s, _| {
                    let c = b.un(UnaryOp::Cos, output(s))?;
                    Ok(vec![Some(b.mul(gy(s), c)?)])
                },
            ),
            UnaryOp::Cos => brk("the minus dropped: dx = g sin x", |b, s, _| {
                let sn = b.un(UnaryOp::Sin, input(s, 0))?;
                Ok(vec![Some(b.mul(gy(s), sn)?)])
            }),
            UnaryOp::Tanh => brk("the input for the output: dx = g (1 - x²)", |b, s, _| {
                let x2 = b.un(UnaryOp::Square, input(s, 0))?;
                let n = b.neg(x2)?;
                let d = b.op(Op::AddScalar { value: 1.0 }, vec![n])?;
                Ok(vec![Some(b.mul(gy(s), d)?)])
            }),
            UnaryOp::Sigmoid => brk("the (1 - y) factor dropped: dx = g y", |b, s, _| {
                Ok(vec![Some(b.mul(gy(s), output(s))?)])
            }),
            UnaryOp::Silu => brk(
                "x·s(x) differentiated as if s were constant: dx = g s(x)",
                |b, s, _| {
                    let sg = b.un(UnaryOp::Sigmoid, input(s, 0))?;
                    Ok(vec![Some(b.mul(gy(s), sg)?)])
                },
            ),
            UnaryOp::Abs => brk("the sign dropped: dx = g", |_, s, _| Ok(vec![Some(gy(s))])),
            UnaryOp::Square => brk("the factor 2 dropped: dx = g x", |b, s, _| {
                Ok(vec![Some(b.mul(gy(s), input(s, 0))?)])
            }),
        },
        Op::Binary(op) => match op {
            BinaryOp::Add => brk("the second operand's gradient dropped", |_, _, c| {
                Ok(vec![c[0], None])
            }),
            BinaryOp::Sub => brk(
                "the minus dropped on the second operand: db = g",
                |_, s, c| Ok(vec![c[0], Some(gy(s))]),
            ),
            BinaryOp::Mul => brk("the wrong operand: db = g b", |b, s, c| {
                Ok(vec![c[0], Some(b.mul(gy(s), input(s, 1))?)])
            }),
            BinaryOp::Div => brk("one 1/b dropped: db = -g y", |b, s, c| {
                let t = b.mul(gy(s), output(s))?;
                Ok(vec![c[0], Some(b.neg(t)?)])
            }),
            BinaryOp::Max | BinaryOp::Min => brk(
                "the comparison reversed: the gradient goes to the operand not selected",
                |_, _, c| Ok(vec![c[1], c[0]]),
            ),
            BinaryOp::Pow => brk("the log dropped: db = g y", |b, s, c| {
                Ok(vec![c[0], Some(b.mul(gy(s), output(s))?)])
            }),
        },
        Op::Compare(_) => Plan::NoRule(
            "bool output: no gradient can flow back through it (zero almost everywhere)",
        ),
        Op::Select => brk("the branches swapped", |_, _, c| Ok(vec![None, c[2], c[1]])),
        Op::AddScalar { .. } => brk("copied from mul_scalar: dx = g c", |b, s, _| {
            let Op::AddScalar { value } = s.node.op else {
                unreachable!()
            };
            Ok(vec![Some(b.mul_scalar(gy(s), value)?)])
        }),
        Op::MulScalar { .. } => brk("the factor dropped: dx = g", |_, s, _| {
            Ok(vec![Some(gy(s))])
        }),
        Op::PowScalar { .. } => brk("the exponent not decremented: dx = g p x^p", |b, s, _| {
            let Op::PowScalar { exponent } = s.node.op else {
                unreachable!()
            };
            let p = b.op(Op::PowScalar { exponent }, vec![input(s, 0)])?;
            let d = b.mul_scalar(p, exponent)?;
            Ok(vec![Some(b.mul(gy(s), d)?)])
        }),
        Op::Cast { .. } => brk("treated as not differentiable: no gradient", |_, _, _| {
            Ok(vec![None])
        }),
        // Identity on values: the only well-typed mistakes are a sign or a scale.
        Op::Offload | Op::Reload => brk(SIGN_FLIP, sign_flip),
        Op::ReduceSum { .. } => brk("a mean's rule: dx = g / n", |b, s, c| {
            let n = b.numel(input(s, 0)) as f64 / b.numel(output(s)) as f64;
            Ok(vec![Some(b.mul_scalar(c[0].unwrap(), 1.0 / n)?)])
        }),
        Op::ReduceMax { .. } => brk("the mask dropped: every element gets g", |b, s, _| {
            let Op::ReduceMax { axes, .. } = &s.node.op else {
                unreachable!()
            };
            let shape = b.shape(input(s, 0));
            Ok(vec![Some(b.broadcast_back(gy(s), axes, &shape)?)])
        }),
        // The rule reshapes back; reshaping to anything else is a type error.
        Op::Reshape { .. } => brk(SIGN_FLIP, sign_flip),
        Op::Transpose { .. } => brk(
            "the permutation applied again instead of inverted",
            |b, s, _| {
                let Op::Transpose { perm } = &s.node.op else {
                    unreachable!()
                };
                Ok(vec![Some(
                    b.op(Op::Transpose { perm: perm.clone() }, vec![gy(s)])?,
                )])
            },
        ),
        Op::Expand { .. } => brk(
            "the mean over the broadcast dims, not the sum",
            |b, s, c| {
                let n = b.numel(output(s)) as f64 / b.numel(input(s, 0)) as f64;
                Ok(vec![Some(b.mul_scalar(c[0].unwrap(), 1.0 / n)?)])
            },
        ),
        Op::Slice { .. } => brk(
            "the gradient placed at offset 0, not at start",
            |b, s, _| {
                let Op::Slice { axis, start, end } = s.node.op else {
                    unreachable!()
                };
                let x = b.g.ty(input(s, 0)).clone();
                let mut rest = x.shape.clone();
                rest[axis] -= end - start;
                let zeros = b.full(0.0, rest, x.dtype)?;
                Ok(vec![Some(b.op(Op::Concat { axis }, vec![gy(s), zeros])?)])
            },
        ),
        Op::Concat { .. } => brk(
            "the offset not advanced: every operand takes the first slice",
            |b, s, _| {
                let Op::Concat { axis } = s.node.op else {
                    unreachable!()
                };
                let mut out = Vec::new();
                for (k, v) in s.node.inputs.iter().enumerate() {
                    let len = b.shape(*v)[axis];
                    out.push(if s.need[k] {
                        Some(b.op(
                            Op::Slice {
                                axis,
                                start: 0,
                                end: len,
                            },
                            vec![gy(s)],
                        )?)
                    } else {
                        None
                    });
                }
                Ok(out)
            },
        ),
        Op::Gather { .. } => brk(
            "scattered onto the input instead of zeros: dx = x + scatter(g)",
            |b, s, _| {
                let Op::Gather { axis } = s.node.op else {
                    unreachable!()
                };
                let (x, idx) = (input(s, 0), input(s, 1));
                Ok(vec![
                    Some(b.op(Op::ScatterAdd { axis }, vec![x, idx, gy(s)])?),
                    None,
                ])
            },
        ),
        Op::ScatterAdd { .. } => brk("the pass-through of x dropped: dx = 0", |_, _, c| {
            Ok(vec![None, None, c[2]])
        }),
        // Well-typed only when K == N, which the matmul cases are.
        Op::Matmul => brk("the transpose of b dropped: da = g b", |b, s, c| {
            Ok(vec![Some(b.matmul(gy(s), input(s, 1))?), c[1]])
        }),
        Op::Full { .. } | Op::Iota { .. } => Plan::NoRule("a source: no operands"),
        Op::RandomUniform { .. } | Op::RandomNormal { .. } => {
            Plan::NoRule("a source: its only operand is the integer seed")
        }
        Op::Embedding => brk(
            "the accumulation over repeated ids lost: a row gets only its last occurrence",
            embedding_last_write_wins,
        ),
        // The rule gathers the rows at the same ids: a wrong index is data, not the rule, and
        // anything but a row gather is a type error.
        Op::EmbeddingBackward { .. } => brk(SIGN_FLIP, sign_flip),
        Op::RmsNorm { .. } => brk(
            "the term through the normalizer dropped: dx = r g w",
            |b, s, c| {
                let Op::RmsNorm { eps } = s.node.op else {
                    unreachable!()
                };
                let (x, w) = (input(s, 0), input(s, 1));
                let shape = b.shape(x);
                let last = shape.len() - 1;
                let sq = b.un(UnaryOp::Square, x)?;
                let ss = b.reduce_sum(sq, vec![last], true)?;
                let ms = b.mul_scalar(ss, 1.0 / shape[last] as f64)?;
                let ms = b.op(Op::AddScalar { value: eps }, vec![ms])?;
                let r = b.un(UnaryOp::Rsqrt, ms)?;
                let r = b.expand(r, shape.clone())?;
                let we = b.broadcast(w, &shape)?;
                let gw = b.mul(gy(s), we)?;
                Ok(vec![Some(b.mul(gw, r)?), c[1]])
            },
        ),
        Op::Rope { .. } => brk("rotated forward again instead of back", |b, s, _| {
            let Op::Rope {
                theta,
                layout,
                inverse,
            } = s.node.op
            else {
                unreachable!()
            };
            Ok(vec![Some(b.op(
                Op::Rope {
                    theta,
                    layout,
                    inverse,
                },
                vec![gy(s)],
            )?)])
        }),
        Op::Attention { .. } => brk(
            "the row term of the softmax backward dropped: ds = p dp",
            attention_without_row_term,
        ),
        Op::Softmax { .. } => brk("the sum term dropped: dx = y g", |b, s, _| {
            Ok(vec![Some(b.mul(output(s), gy(s))?)])
        }),
        Op::LogSoftmax { .. } => brk("the sum term dropped: dx = g", |_, s, _| {
            Ok(vec![Some(gy(s))])
        }),
        Op::CrossEntropy => brk(
            "the one-hot term dropped: dlogits = softmax(logits) g / N",
            |b, s, _| {
                let logits = input(s, 0);
                let shape = b.shape(logits);
                let p = b.op(Op::Softmax { axis: 1 }, vec![logits])?;
                let g = b.broadcast(gy(s), &shape)?;
                let t = b.mul(p, g)?;
                Ok(vec![Some(b.mul_scalar(t, 1.0 / shape[0] as f64)?), None])
            },
        ),
        Op::RmsNormBackward { .. } | Op::AttentionBackward { .. } | Op::CrossEntropyBackward => {
            Plan::NoRule("a backward op: no second-order gradients; autodiff refuses it")
        }
        Op::AdamW { .. } | Op::Sgd { .. } => {
            Plan::NoRule("an optimizer step: never differentiated; autodiff refuses it")
        }
        Op::CollectiveStart { .. } | Op::Wait | Op::ToPartial { .. } => Plan::OnRanks,
    }
}

/// Embedding's rule with the accumulation lost: of the positions holding the same id, only the
/// last one's gradient reaches the row (a scatter that overwrites instead of adding).
fn embedding_last_write_wins(
    b: &mut Bld<'_>,
    s: &RuleSite<'_>,
    _: Cots,
) -> Result<Cots, TypeError> {
    let (w, ids) = (input(s, 0), input(s, 1));
    let (rows, d) = (b.shape(w)[0], b.shape(w)[1]);
    let n = b.numel(ids);
    let dt = b.g.ty(w).dtype;
    let id_dt = b.g.ty(ids).dtype;
    // hit[p, r]: position p holds id r.
    let col = b.reshape(ids, vec![n, 1])?;
    let col = b.expand(col, vec![n, rows])?;
    let row = b.op(
        Op::Iota {
            shape: vec![n, rows],
            axis: 1,
            dtype: id_dt,
        },
        vec![],
    )?;
    let hit = b.op(Op::Compare(CompareOp::Eq), vec![col, row])?;
    // last[r]: the last position holding id r (-1 if none).
    let pos = b.op(
        Op::Iota {
            shape: vec![n, rows],
            axis: 0,
            dtype: dt,
        },
        vec![],
    )?;
    let none = b.full(-1.0, vec![n, rows], dt)?;
    let at = b.op(Op::Select, vec![hit, pos, none])?;
    let last = b.op(
        Op::ReduceMax {
            axes: vec![0],
            keepdim: true,
        },
        vec![at],
    )?;
    let last = b.expand(last, vec![n, rows])?;
    let is_last = b.op(Op::Compare(CompareOp::Eq), vec![pos, last])?;
    let one = b.full(1.0, vec![n, rows], dt)?;
    let zero = b.full(0.0, vec![n, rows], dt)?;
    let sel = b.op(Op::Select, vec![is_last, one, zero])?;
    let selt = b.op(Op::Transpose { perm: vec![1, 0] }, vec![sel])?;
    let g = b.reshape(gy(s), vec![n, d])?;
    Ok(vec![Some(b.matmul(selt, g)?), None])
}

/// Attention's rule without the row term of the softmax backward: `ds = p ∘ dp` instead of
/// `p ∘ (dp - rowsum(p ∘ dp))`, for dq and dk; dv is the rule's.
fn attention_without_row_term(
    b: &mut Bld<'_>,
    s: &RuleSite<'_>,
    c: Cots,
) -> Result<Cots, TypeError> {
    let Op::Attention { causal, scale, .. } = s.node.op else {
        unreachable!()
    };
    let (q, k, v) = (input(s, 0), input(s, 1), input(s, 2));
    let (qs, ks) = (b.shape(q), b.shape(k));
    let (bs, hq, sl, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, group) = (ks[1], qs[1] / ks[1]);
    // kv head h / group serves query head h.
    let repeat = |b: &mut Bld<'_>, t: ValueId| -> R {
        let t = b.reshape(t, vec![bs, hkv, 1, sl, d])?;
        let t = b.expand(t, vec![bs, hkv, group, sl, d])?;
        b.reshape(t, vec![bs, hq, sl, d])
    };
    let sum_groups = |b: &mut Bld<'_>, t: ValueId| -> R {
        let t = b.reshape(t, vec![bs, hkv, group, sl, d])?;
        b.reduce_sum(t, vec![2], false)
    };
    let (ke, ve) = (repeat(b, k)?, repeat(b, v)?);
    let kt = b.transpose_last(ke)?;
    let raw = b.matmul(q, kt)?;
    let mut scores = b.mul_scalar(raw, scale)?;
    if causal {
        let shape = b.shape(scores);
        let i = b.op(
            Op::Iota {
                shape: vec![sl, sl],
                axis: 0,
                dtype: DType::I64,
            },
            vec![],
        )?;
        let j = b.op(
            Op::Iota {
                shape: vec![sl, sl],
                axis: 1,
                dtype: DType::I64,
            },
            vec![],
        )?;
        let future = b.op(Op::Compare(CompareOp::Gt), vec![j, i])?;
        let future = b.broadcast(future, &shape)?;
        let ninf = b.full(f64::NEG_INFINITY, shape, F)?;
        scores = b.op(Op::Select, vec![future, ninf, scores])?;
    }
    let p = b.op(Op::Softmax { axis: 3 }, vec![scores])?;
    let vt = b.transpose_last(ve)?;
    let dp = b.matmul(gy(s), vt)?;
    let ds = b.mul(p, dp)?;
    let dq = b.matmul(ds, ke)?;
    let dq = b.mul_scalar(dq, scale)?;
    let dst = b.transpose_last(ds)?;
    let dk = b.matmul(dst, q)?;
    let dk = b.mul_scalar(dk, scale)?;
    let dk = sum_groups(b, dk)?;
    Ok(vec![Some(dq), Some(dk), c[2]])
}

/// Appends nodes for a break, with the rule's metadata.
struct Bld<'g> {
    g: &'g mut Graph,
    meta: Meta,
}

impl Bld<'_> {
    fn op(&mut self, op: Op, ins: Vec<ValueId>) -> R {
        self.g.push1(op, ins, self.meta.clone())
    }
    fn shape(&self, v: ValueId) -> Vec<usize> {
        self.g.ty(v).shape.clone()
    }
    fn numel(&self, v: ValueId) -> usize {
        self.g.ty(v).numel()
    }
    fn un(&mut self, u: UnaryOp, x: ValueId) -> R {
        self.op(Op::Unary(u), vec![x])
    }
    fn bin(&mut self, op: BinaryOp, x: ValueId, y: ValueId) -> R {
        self.op(Op::Binary(op), vec![x, y])
    }
    fn mul(&mut self, x: ValueId, y: ValueId) -> R {
        self.bin(BinaryOp::Mul, x, y)
    }
    fn neg(&mut self, x: ValueId) -> R {
        self.un(UnaryOp::Neg, x)
    }
    fn mul_scalar(&mut self, x: ValueId, value: f64) -> R {
        self.op(Op::MulScalar { value }, vec![x])
    }
    fn full(&mut self, value: f64, shape: Vec<usize>, dtype: DType) -> R {
        self.op(
            Op::Full {
                value,
                shape,
                dtype,
            },
            vec![],
        )
    }
    fn reshape(&mut self, x: ValueId, shape: Vec<usize>) -> R {
        self.op(Op::Reshape { shape }, vec![x])
    }
    fn expand(&mut self, x: ValueId, shape: Vec<usize>) -> R {
        self.op(Op::Expand { shape }, vec![x])
    }
    fn matmul(&mut self, a: ValueId, b: ValueId) -> R {
        self.op(Op::Matmul, vec![a, b])
    }
    fn reduce_sum(&mut self, x: ValueId, axes: Vec<usize>, keepdim: bool) -> R {
        self.op(Op::ReduceSum { axes, keepdim }, vec![x])
    }
    fn transpose_last(&mut self, x: ValueId) -> R {
        let r = self.shape(x).len();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.op(Op::Transpose { perm }, vec![x])
    }
    /// `x` of a trailing shape of `shape` (or a scalar) broadcast to `shape`.
    fn broadcast(&mut self, x: ValueId, shape: &[usize]) -> R {
        let xs = self.shape(x);
        let mut padded = vec![1; shape.len() - xs.len()];
        padded.extend(xs);
        let x = self.reshape(x, padded)?;
        self.expand(x, shape.to_vec())
    }
    /// `x`, reduced over `axes` of `shape`, broadcast back to `shape`.
    fn broadcast_back(&mut self, x: ValueId, axes: &[usize], shape: &[usize]) -> R {
        let keep: Vec<usize> = (0..shape.len())
            .map(|i| if axes.contains(&i) { 1 } else { shape[i] })
            .collect();
        let x = self.reshape(x, keep)?;
        self.expand(x, shape.to_vec())
    }
}

// ---------------------------------------------------------------------------------------------
// Cases

/// How to fill a case input.
#[derive(Clone, Copy)]
enum Fill {
    /// N(0, 1), differentiated.
    Normal,
    /// Uniform in [lo, hi), differentiated.
    Range(f64, f64),
    /// Integers in 0..n, not differentiated.
    Index(usize),
    /// N(0, 1), not differentiated (a data input such as a weight that is held fixed).
    Fixed,
}

struct Case {
    name: String,
    graph: Graph,
    fills: Vec<Fill>,
    /// The op under test: the rule the sensitivity test breaks, on the case's own nodes of this
    /// kind (not on the nodes that build the checked scalar).
    op: Op,
    /// Finite-difference step and relative tolerance.
    h: f64,
    rtol: f64,
}

/// Step and tolerance of an all-f64 case.
const H64: f64 = 1e-6;
const RTOL64: f64 = 1e-6;

fn case(name: &str, inputs: &[(TensorType, Fill)], op: Op) -> Case {
    let mut g = Graph::new(name);
    let ins: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, (t, _))| g.add_input(format!("x{i}"), InputKind::Data, t.clone()))
        .collect();
    let outs = g
        .push(op.clone(), ins, Meta::default())
        .unwrap_or_else(|e| panic!("case {name}: {e}"));
    for (k, o) in outs.iter().enumerate() {
        g.add_output(format!("y{k}"), *o, None);
    }
    Case {
        name: name.to_string(),
        graph: g,
        fills: inputs.iter().map(|(_, f)| *f).collect(),
        op,
        h: H64,
        rtol: RTOL64,
    }
}

fn t(shape: &[usize]) -> TensorType {
    TensorType::new(F, shape.to_vec())
}

fn ti(shape: &[usize]) -> TensorType {
    TensorType::new(DType::I32, shape.to_vec())
}

/// The cases of every op with a gradient rule.
fn all_cases() -> Vec<Case> {
    use Fill::*;
    let mut cases = Vec::new();
    for u in UnaryOp::ALL {
        let fill = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => Range(0.5, 2.0),
            _ => Normal,
        };
        cases.push(case(u.name(), &[(t(&[3, 5]), fill)], Op::Unary(u)));
    }
    for b in BinaryOp::ALL {
        let (fa, fb) = match b {
            BinaryOp::Div => (Normal, Range(0.5, 2.0)),
            BinaryOp::Pow => (Range(0.5, 2.0), Range(-1.5, 1.5)),
            _ => (Normal, Normal),
        };
        cases.push(case(
            b.name(),
            &[(t(&[4, 3]), fa), (t(&[4, 3]), fb)],
            Op::Binary(b),
        ));
    }
    cases.push(case(
        "add_scalar",
        &[(t(&[5]), Normal)],
        Op::AddScalar { value: 0.7 },
    ));
    cases.push(case(
        "mul_scalar",
        &[(t(&[5]), Normal)],
        Op::MulScalar { value: -1.3 },
    ));
    cases.push(case(
        "pow_scalar",
        &[(t(&[5]), Range(0.5, 2.0))],
        Op::PowScalar { exponent: 2.5 },
    ));
    cases.push(cast_case());
    cases.push(case("offload", &[(t(&[2, 3]), Normal)], Op::Offload));
    cases.push(case("reload", &[(t(&[2, 3]), Normal)], Op::Reload));
    cases.push(case(
        "reduce_sum",
        &[(t(&[2, 3, 4]), Normal)],
        Op::ReduceSum {
            axes: vec![0, 2],
            keepdim: false,
        },
    ));
    cases.push(case(
        "reduce_max",
        &[(t(&[3, 5]), Normal)],
        Op::ReduceMax {
            axes: vec![1],
            keepdim: true,
        },
    ));
    cases.push(case(
        "reshape",
        &[(t(&[2, 6]), Normal)],
        Op::Reshape { shape: vec![3, 4] },
    ));
    // A 4-cycle on [2, 3, 2, 3]: the permutation is not its own inverse, and applying it twice
    // gives back the shape, so a rule that forgets to invert it is a numeric error, not a type one.
    cases.push(case(
        "transpose",
        &[(t(&[2, 3, 2, 3]), Normal)],
        Op::Transpose {
            perm: vec![1, 2, 3, 0],
        },
    ));
    cases.push(case(
        "expand",
        &[(t(&[2, 1, 3]), Normal)],
        Op::Expand {
            shape: vec![2, 4, 3],
        },
    ));
    cases.push(case(
        "slice",
        &[(t(&[3, 7]), Normal)],
        Op::Slice {
            axis: 1,
            start: 2,
            end: 5,
        },
    ));
    cases.push(case(
        "concat",
        &[
            (t(&[2, 3]), Normal),
            (t(&[2, 1]), Normal),
            (t(&[2, 2]), Normal),
        ],
        Op::Concat { axis: 1 },
    ));
    cases.push(case(
        "gather",
        &[(t(&[4, 3]), Normal), (ti(&[6, 3]), Index(4))],
        Op::Gather { axis: 0 },
    ));
    cases.push(case(
        "scatter_add",
        &[
            (t(&[4, 3]), Normal),
            (ti(&[4, 5]), Index(3)),
            (t(&[4, 5]), Normal),
        ],
        Op::ScatterAdd { axis: 1 },
    ));
    // K == N (a missing transpose of b type-checks), M != K (the other transposes do not).
    cases.push(case(
        "matmul",
        &[(t(&[2, 3, 4]), Normal), (t(&[2, 4, 4]), Normal)],
        Op::Matmul,
    ));
    cases.push(case(
        "matmul_shared_rhs",
        &[(t(&[2, 3, 4]), Normal), (t(&[4, 4]), Normal)],
        Op::Matmul,
    ));
    // 8 ids among 7 rows: some id repeats, so the accumulation is exercised.
    cases.push(case(
        "embedding",
        &[(t(&[7, 3]), Normal), (ti(&[2, 4]), Index(7))],
        Op::Embedding,
    ));
    cases.push(case(
        "embedding_backward",
        &[(t(&[2, 4, 3]), Normal), (ti(&[2, 4]), Index(5))],
        Op::EmbeddingBackward { rows: 5 },
    ));
    cases.push(case(
        "rms_norm",
        &[(t(&[2, 3, 6]), Normal), (t(&[6]), Normal)],
        Op::RmsNorm { eps: 1e-5 },
    ));
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        for inverse in [false, true] {
            cases.push(case(
                &format!("rope_{}_{inverse}", layout.name()),
                &[(t(&[2, 5, 2, 6]), Normal)],
                Op::Rope {
                    theta: 10000.0,
                    layout,
                    inverse,
                },
            ));
        }
    }
    for causal in [true, false] {
        cases.push(case(
            &format!("attention_gqa_causal_{causal}"),
            &[
                (t(&[2, 4, 5, 3]), Normal),
                (t(&[2, 2, 5, 3]), Normal),
                (t(&[2, 2, 5, 3]), Normal),
            ],
            Op::Attention {
                causal,
                scale: 0.6,
                stats: false,
            },
        ));
    }
    cases.push(case(
        "softmax",
        &[(t(&[3, 5]), Normal)],
        Op::Softmax { axis: 1 },
    ));
    cases.push(case(
        "softmax_axis0",
        &[(t(&[3, 5]), Normal)],
        Op::Softmax { axis: 0 },
    ));
    cases.push(case(
        "log_softmax",
        &[(t(&[3, 5]), Normal)],
        Op::LogSoftmax { axis: 1 },
    ));
    cases.push(case(
        "cross_entropy",
        &[(t(&[6, 5]), Normal), (ti(&[6]), Index(5))],
        Op::CrossEntropy,
    ));
    cases.push(select_case());
    cases
}

/// `cast` between dtypes: `x: f64 -> f32 -> tanh -> f64`, so both casts and the f32 part carry
/// the gradient. The values are rounded to f32, so the step is larger (the rounding of the loss
/// is about 1e-7, divided by 2h) and the tolerance fits f32.
fn cast_case() -> Case {
    let m = Meta::default();
    let mut g = Graph::new("cast");
    let x = g.add_input("x0", InputKind::Data, t(&[2, 3]));
    let x32 = g
        .push1(Op::Cast { dtype: DType::F32 }, vec![x], m.clone())
        .unwrap();
    let y32 = g
        .push1(Op::Unary(UnaryOp::Tanh), vec![x32], m.clone())
        .unwrap();
    let y = g.push1(Op::Cast { dtype: F }, vec![y32], m).unwrap();
    g.add_output("y0", y, None);
    Case {
        name: "cast_f64_f32_f64".into(),
        graph: g,
        fills: vec![Fill::Normal],
        op: Op::Cast { dtype: DType::F32 },
        h: 1e-3,
        rtol: 1e-3,
    }
}

/// `select`: the condition comes from a compare of a fixed input, inside the same graph.
fn select_case() -> Case {
    let mut g = Graph::new("select");
    let c = g.add_input("x0", InputKind::Data, t(&[3, 4]));
    let a = g.add_input("x1", InputKind::Data, t(&[3, 4]));
    let b = g.add_input("x2", InputKind::Data, t(&[3, 4]));
    let zero = g
        .push1(
            Op::Full {
                value: 0.0,
                shape: vec![3, 4],
                dtype: F,
            },
            vec![],
            Meta::default(),
        )
        .unwrap();
    let cond = g
        .push1(Op::Compare(CompareOp::Gt), vec![c, zero], Meta::default())
        .unwrap();
    let y = g
        .push1(Op::Select, vec![cond, a, b], Meta::default())
        .unwrap();
    g.add_output("y0", y, None);
    Case {
        name: "select".into(),
        graph: g,
        fills: vec![Fill::Fixed, Fill::Normal, Fill::Normal],
        op: Op::Select,
        h: H64,
        rtol: RTOL64,
    }
}

/// One case of every op kind without a gradient rule, with operands it accepts.
fn no_rule_cases() -> Vec<Case> {
    use Fill::*;
    let mut cases = Vec::new();
    for c in CompareOp::ALL {
        cases.push(case(
            c.name(),
            &[(t(&[3]), Normal), (t(&[3]), Normal)],
            Op::Compare(c),
        ));
    }
    cases.push(case(
        "full",
        &[],
        Op::Full {
            value: 1.0,
            shape: vec![3],
            dtype: F,
        },
    ));
    cases.push(case(
        "iota",
        &[],
        Op::Iota {
            shape: vec![3],
            axis: 0,
            dtype: F,
        },
    ));
    let seed = TensorType::new(DType::I64, vec![]);
    cases.push(case(
        "random_uniform",
        &[(seed.clone(), Index(100))],
        Op::RandomUniform {
            shape: vec![3],
            dtype: F,
            stream: 1,
        },
    ));
    cases.push(case(
        "random_normal",
        &[(seed, Index(100))],
        Op::RandomNormal {
            shape: vec![3],
            dtype: F,
            stream: 1,
        },
    ));
    cases.push(case(
        "rms_norm_backward",
        &[
            (t(&[2, 6]), Normal),
            (t(&[6]), Normal),
            (t(&[2, 6]), Normal),
        ],
        Op::RmsNormBackward { eps: 1e-5 },
    ));
    let q = t(&[1, 2, 3, 4]);
    let kv = t(&[1, 1, 3, 4]);
    cases.push(case(
        "attention_backward",
        &[
            (q.clone(), Normal),
            (kv.clone(), Normal),
            (kv, Normal),
            (q, Normal),
        ],
        Op::AttentionBackward {
            causal: true,
            scale: 0.5,
            stats: false,
        },
    ));
    cases.push(case(
        "cross_entropy_backward",
        &[(t(&[3, 4]), Normal), (ti(&[3]), Index(4)), (t(&[]), Normal)],
        Op::CrossEntropyBackward,
    ));
    cases.push(case(
        "adamw",
        &[
            (t(&[4]), Normal),
            (t(&[4]), Normal),
            (t(&[4]), Normal),
            (t(&[4]), Normal),
            (t(&[]), Normal),
            (t(&[]), Normal),
        ],
        Op::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    ));
    cases.push(case(
        "sgd",
        &[(t(&[4]), Normal), (t(&[4]), Normal), (t(&[]), Normal)],
        Op::Sgd { weight_decay: 0.1 },
    ));
    cases
}

// ---------------------------------------------------------------------------------------------
// The check

fn fill(f: Fill, ty: &TensorType, seed: u64) -> HostTensor {
    let n = ty.numel();
    let data = (0..n as u64)
        .map(|i| match f {
            Fill::Normal | Fill::Fixed => rng::normal(seed, 0, i),
            Fill::Range(lo, hi) => lo + (hi - lo) * rng::uniform(seed, 0, i),
            Fill::Index(k) => rng::below(seed, 0, i, k as u64) as f64,
        })
        .collect();
    HostTensor {
        ty: ty.clone(),
        data,
    }
}

enum Outcome {
    /// Every analytic derivative matched its finite difference (this many were checked).
    Match(usize),
    /// An analytic derivative differs from its finite difference: the only outcome that counts
    /// as catching a broken rule.
    Mismatch(String),
    /// Nothing was compared: autodiff, the verifier or the interpreter failed, a gradient has the
    /// wrong type, a finite difference is not finite, or the check panicked.
    Error(String),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Match(n) => write!(f, "all {n} derivatives match"),
            Outcome::Mismatch(m) => write!(f, "mismatch: {m}"),
            Outcome::Error(e) => write!(f, "error: {e}"),
        }
    }
}

impl Outcome {
    fn caught(&self) -> bool {
        matches!(self, Outcome::Mismatch(_))
    }
}

/// The loss `Σ_k sum(y_k * r_k)` over the case's float outputs, with new inputs `r_k`.
fn weighted_loss(g: &mut Graph) -> Option<ValueId> {
    let m = Meta::default();
    let outs: Vec<ValueId> = g.outputs.iter().map(|o| o.value).collect();
    g.outputs.clear();
    let mut loss = None;
    for (k, y) in outs.iter().enumerate() {
        let ty = g.ty(*y).clone();
        if !ty.dtype.is_float() {
            continue;
        }
        let r = g.add_input(format!("r{k}"), InputKind::Data, ty.clone());
        let p = g
            .push1(Op::Binary(BinaryOp::Mul), vec![*y, r], m.clone())
            .unwrap();
        let s = g
            .push1(
                Op::ReduceSum {
                    axes: (0..ty.rank()).collect(),
                    keepdim: false,
                },
                vec![p],
                m.clone(),
            )
            .unwrap();
        loss = Some(match loss {
            None => s,
            Some(l) => g
                .push1(Op::Binary(BinaryOp::Add), vec![l, s], m.clone())
                .unwrap(),
        });
    }
    loss
}

/// The differentiated inputs of a case: `(input index, value)`.
fn differentiated(c: &Case, g: &Graph) -> Vec<(usize, ValueId)> {
    c.fills
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f, Fill::Normal | Fill::Range(..)))
        .map(|(i, _)| (i, g.inputs[i].value))
        .collect()
}

/// Runs the gradcheck of one case, with the rules replaced by `hook` where it says so.
fn gradcheck(c: &Case, hook: Option<RuleHook<'_>>) -> Outcome {
    match catch_unwind(AssertUnwindSafe(|| gradcheck_inner(c, hook))) {
        Ok(o) => o,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Outcome::Error(format!("panicked: {msg}"))
        }
    }
}

fn gradcheck_inner(c: &Case, hook: Option<RuleHook<'_>>) -> Outcome {
    use Outcome::{Error, Match, Mismatch};
    let mut g = c.graph.clone();
    let Some(loss) = weighted_loss(&mut g) else {
        return Error("the case has no float output".into());
    };
    let wrt = differentiated(c, &g);
    let opts = GradOptions {
        replace_rule: hook,
        ..GradOptions::default()
    };
    let wrt_values: Vec<ValueId> = wrt.iter().map(|w| w.1).collect();
    let grads = match grad_with(&mut g, loss, &wrt_values, &opts) {
        Ok(gr) => gr,
        Err(e) => return Error(format!("autodiff failed: {e}")),
    };
    for (gr, w) in grads.iter().zip(&wrt_values) {
        if g.ty(*gr) != g.ty(*w) {
            return Error(format!(
                "a gradient has type {}, its input {}",
                g.ty(*gr),
                g.ty(*w)
            ));
        }
    }
    g.add_output("loss", loss, None);
    for (k, gr) in grads.iter().enumerate() {
        g.add_output(format!("grad{k}"), *gr, None);
    }
    if let Err(e) = verify(&g) {
        return Error(format!("gradient graph is invalid: {e}"));
    }

    let mut inputs: Vec<HostTensor> = Vec::new();
    for (i, input) in g.inputs.iter().enumerate() {
        let f = c.fills.get(i).copied().unwrap_or(Fill::Fixed);
        inputs.push(fill(f, g.ty(input.value), 1000 + i as u64));
    }
    let base = match run(&g, &inputs) {
        Ok(b) => b,
        Err(e) => return Error(format!("run failed: {e}")),
    };
    let loss_at = |inputs: &[HostTensor]| run(&g, inputs).map(|r| r.outputs[0].data[0]);

    let h = c.h;
    let mut checked = 0;
    for (k, (input_idx, _)) in wrt.iter().enumerate() {
        let analytic = &base.outputs[1 + k].data;
        for (e, &a) in analytic.iter().enumerate() {
            let x0 = inputs[*input_idx].data[e];
            inputs[*input_idx].data[e] = x0 + h;
            let up = loss_at(&inputs);
            inputs[*input_idx].data[e] = x0 - h;
            let down = loss_at(&inputs);
            inputs[*input_idx].data[e] = x0;
            let (up, down) = match (up, down) {
                (Ok(u), Ok(d)) => (u, d),
                (Err(e), _) | (_, Err(e)) => return Error(format!("perturbed run failed: {e}")),
            };
            let numeric = (up - down) / (2.0 * h);
            if !numeric.is_finite() {
                return Error(format!(
                    "x{input_idx} element {e}: finite difference {numeric}"
                ));
            }
            let tol = c.rtol * (1.0 + numeric.abs().max(a.abs()));
            // A NaN analytic value is a mismatch too (it compares false with everything).
            if a.is_nan() || (numeric - a).abs() > tol {
                return Mismatch(format!(
                    "x{input_idx} element {e}: analytic {a:.10} vs numeric {numeric:.10}"
                ));
            }
            checked += 1;
        }
    }
    Match(checked)
}

/// Gradcheck of `c` with `apply` in place of the rule of the case's own nodes of `c.op`'s kind
/// (never the nodes that build the checked scalar), and how many times it was applied.
fn gradcheck_broken(c: &Case, apply: BreakFn) -> (Outcome, usize) {
    let applied = Cell::new(0);
    let own_nodes = c.graph.nodes.len();
    let name = c.op.name();
    let hook = |g: &mut Graph, s: &RuleSite<'_>, cots: Cots| {
        if s.index >= own_nodes || s.node.op.name() != name {
            return Ok(cots);
        }
        applied.set(applied.get() + 1);
        let mut b = Bld {
            g,
            meta: s.meta.clone(),
        };
        apply(&mut b, s, cots)
    };
    let outcome = gradcheck(c, Some(&hook));
    (outcome, applied.get())
}

fn no_op(_: &mut Bld<'_>, _: &RuleSite<'_>, c: Cots) -> Result<Cots, TypeError> {
    Ok(c)
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn every_gradient_rule_matches_finite_differences() {
    let mut failures = Vec::new();
    for c in all_cases() {
        match gradcheck(&c, None) {
            Outcome::Match(n) if n > 0 => {}
            other => failures.push(format!("{}: {other}", c.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "gradcheck failures:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_broken_rule_is_caught() {
    // One rule at a time, each in its own cases: only a numeric mismatch is a catch.
    let mut missed = Vec::new();
    for c in all_cases() {
        let Plan::Rule(b) = plan(&c.op) else {
            missed.push(format!("{}: case of an op without a rule", c.name));
            continue;
        };
        let (outcome, applied) = gradcheck_broken(&c, b.apply);
        println!("{} ({}): {outcome}", c.name, b.what);
        if applied == 0 {
            missed.push(format!("{}: the break was never applied", c.name));
        } else if !outcome.caught() {
            missed.push(format!("{} ({}): not caught: {outcome}", c.name, b.what));
        }
    }
    assert!(
        missed.is_empty(),
        "broken rules not caught:\n{}",
        missed.join("\n")
    );
}

#[test]
fn a_no_op_break_is_not_caught() {
    // Selecting the node and handing back the rule's own cotangents must change nothing: a break
    // that does nothing is reported as not caught, for every case.
    let mut wrong = Vec::new();
    for c in all_cases() {
        let (outcome, applied) = gradcheck_broken(&c, no_op);
        if applied == 0 || outcome.caught() || !matches!(outcome, Outcome::Match(_)) {
            wrong.push(format!("{}: applied {applied} times, {outcome}", c.name));
        }
    }
    assert!(
        wrong.is_empty(),
        "a no-op break did not pass:\n{}",
        wrong.join("\n")
    );
}

const DELIBERATE: &str = "deliberate panic in a test break (expected)";

#[test]
fn an_error_is_not_a_catch() {
    // Keep the deliberate panic below out of the test output; every other panic still prints.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&DELIBERATE) {
            default_hook(info);
        }
    }));
    let c = all_cases().into_iter().find(|c| c.name == "neg").unwrap();
    let breaks: [(&str, BreakFn); 3] = [
        ("an ill-typed node", |b, s, _| {
            let wrong = b.full(0.0, vec![1], F)?;
            Ok(vec![Some(b.bin(BinaryOp::Add, gy(s), wrong)?)])
        }),
        ("a gradient of the wrong shape", |b, _, _| {
            Ok(vec![Some(b.full(0.0, vec![15], F)?)])
        }),
        ("a panic", |_, _, _| std::panic::panic_any(DELIBERATE)),
    ];
    for (what, apply) in breaks {
        let (outcome, applied) = gradcheck_broken(&c, apply);
        assert_eq!(applied, 1, "{what}");
        assert!(
            matches!(outcome, Outcome::Error(_)) && !outcome.caught(),
            "{what}: {outcome}"
        );
    }
}

#[test]
fn every_op_kind_has_a_case_or_no_rule() {
    let kinds = every_op_kind();
    let names: Vec<&str> = kinds.iter().map(Op::name).collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "an op kind is listed twice");
    // The parser's list of op names is the same op set.
    let known: BTreeSet<&str> = Op::all_names().into_iter().collect();
    assert_eq!(unique, known, "every_op_kind and Op::all_names disagree");

    let cases = all_cases();
    let no_rule = no_rule_cases();
    let mut problems = Vec::new();
    for op in &kinds {
        let name = op.name();
        match plan(op) {
            Plan::Rule(_) => {
                if !cases.iter().any(|c| c.op.name() == name) {
                    problems.push(format!("{name}: has a rule but no gradcheck case"));
                }
            }
            Plan::NoRule(_) => {
                if !no_rule.iter().any(|c| c.op.name() == name) {
                    problems.push(format!("{name}: has no rule but no case showing it"));
                }
            }
            Plan::OnRanks => {}
        }
    }
    for c in &cases {
        if !matches!(plan(&c.op), Plan::Rule(_)) {
            problems.push(format!(
                "{}: a gradcheck case of an op without a rule",
                c.name
            ));
        }
    }
    for c in &no_rule {
        if !matches!(plan(&c.op), Plan::NoRule(_)) {
            problems.push(format!("{}: listed without a rule but has one", c.name));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn ops_without_a_rule_are_refused_or_carry_no_gradient() {
    // Autodiff agrees with `plan`: where the op has a float operand and a float output, asking
    // for the gradient through it is an error naming it; otherwise no gradient can reach a rule.
    for c in no_rule_cases() {
        let Plan::NoRule(reason) = plan(&c.op) else {
            panic!("{}: has a rule", c.name);
        };
        let mut g = c.graph.clone();
        let float_in = g.inputs.iter().any(|i| g.ty(i.value).dtype.is_float());
        let loss = weighted_loss(&mut g);
        match (float_in, loss) {
            (true, Some(loss)) => {
                let wrt: Vec<ValueId> = differentiated(&c, &g).iter().map(|w| w.1).collect();
                match grad_with(&mut g, loss, &wrt, &GradOptions::default()) {
                    Err(AutodiffError::NotDifferentiable { op, .. }) => {
                        assert_eq!(op, c.op.name(), "{}", c.name)
                    }
                    other => panic!("{} ({reason}): autodiff gave {other:?}", c.name),
                }
            }
            _ => assert!(
                !reason.contains("refuses"),
                "{}: said to be refused, but nothing can reach it",
                c.name
            ),
        }
    }
}
