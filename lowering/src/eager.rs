//! Eager lowering: one step per unfolded node, every operand and result a whole contiguous
//! buffer. The numerics baseline: fused lowering is held bitwise to it.
//!
//! It also holds the per-node translation both modes share, so that a fused step is by
//! construction the eager step of the same node, only reading through views or with producers
//! inlined: `elementwise_expr` (an elementwise node as an `Expr` over its operands) and
//! `structural_steps` (every other node, reading its operands through a view function: whole
//! buffers here, the views fusion resolved there).
//!
//! Declines (`LowerError` naming the node): a node no step implements, which is a composite that
//! `keep` accepted without a kernel in `Step` (only `kept_composite`'s have one) or one that
//! should have been decomposed; a matmul operand view with no batched form (an internal error).

use crate::lower::err;
use crate::program::{
    AdamWUpdate, Bf16Rounding, Expr, LowerError, MapInput, ReduceKind, Step, View,
};
use crate::views::{as_batched, expand_view, reshape_view, slice_view, transpose_view};
use graphtrain_ir::{BinaryOp, DType, Graph, Op, ValueId};

/// Eager: one step per node, every operand and result a whole contiguous buffer.
#[allow(clippy::needless_range_loop)] // `k` names the node in errors and in `structural_steps`
pub(crate) fn eager_steps(g: &Graph, folded: &[bool]) -> Result<Vec<Step>, LowerError> {
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
pub(crate) fn structural_steps(
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
                bf16: Bf16Rounding {
                    a: false,
                    b: false,
                    out: g.ty(out).dtype == DType::BF16,
                },
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
        Op::Attention { causal, scale, .. } => Step::Attention {
            out: whole_out,
            q: view_of(n.inputs[0]),
            k: view_of(n.inputs[1]),
            v: view_of(n.inputs[2]),
            stats: n.outputs.get(1).copied(),
            causal: *causal,
            scale: *scale,
            bf16: g.ty(n.inputs[0]).dtype == DType::BF16,
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
        Op::AttentionBackward { causal, scale, .. } => Step::AttentionBackward {
            dq: View::contiguous(n.outputs[0], &g.ty(n.outputs[0]).shape),
            dk: View::contiguous(n.outputs[1], &g.ty(n.outputs[1]).shape),
            dv: View::contiguous(n.outputs[2], &g.ty(n.outputs[2]).shape),
            q: view_of(n.inputs[0]),
            k: view_of(n.inputs[1]),
            v: view_of(n.inputs[2]),
            dout: view_of(n.inputs[3]),
            stats: n.inputs.get(4).copied(),
            causal: *causal,
            scale: *scale,
            bf16: g.ty(n.inputs[0]).dtype == DType::BF16,
        },
        Op::RandomUniform { stream, .. } | Op::RandomNormal { stream, .. } => Step::Random {
            out,
            seed: n.inputs[0],
            stream: *stream,
            normal: matches!(n.op, Op::RandomNormal { .. }),
        },
        Op::CollectiveStart {
            collective,
            mesh_dims,
            ..
        } => Step::CollectiveStart {
            collective: *collective,
            mesh_dims: mesh_dims.clone(),
            src: n.inputs[0],
            handle: out,
        },
        // Not elementwise: an identity inlined into its reader would keep the value in the
        // arena, which is what offloading exists to avoid.
        Op::Offload => Step::Offload {
            src: n.inputs[0],
            out,
        },
        Op::Reload => Step::Reload {
            src: n.inputs[0],
            out,
        },
        Op::Wait => Step::Wait {
            handle: n.inputs[0],
            src: collective_operand(g, n.inputs[0]).ok_or_else(|| {
                err(
                    g,
                    k,
                    "a wait whose handle no collective start produced".into(),
                )
            })?,
            out,
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

/// The operand of the collective start that produced `handle`.
fn collective_operand(g: &Graph, handle: ValueId) -> Option<ValueId> {
    g.nodes
        .iter()
        .find(|n| n.outputs.first() == Some(&handle))
        .filter(|n| matches!(n.op, Op::CollectiveStart { .. }))
        .map(|n| n.inputs[0])
}

/// The elementwise expression of a node over its operands, if it is elementwise.
pub(crate) fn elementwise_expr(g: &Graph, k: usize) -> Option<Expr> {
    let n = &g.nodes[k];
    let e = f32_expr(g, k)?;
    // A bf16 result is held as f32 rounded to bf16; a bf16 operand already is one, so a result
    // that only moves or widens it needs no rounding.
    let moves_bf16 = matches!(e, Expr::Input(_)) && g.ty(n.inputs[0]).dtype == DType::BF16;
    Some(if g.ty(n.outputs[0]).dtype == DType::BF16 && !moves_bf16 {
        Expr::RoundBf16(Box::new(e))
    } else {
        e
    })
}

/// `elementwise_expr` before its result is rounded to a bf16 output.
fn f32_expr(g: &Graph, k: usize) -> Option<Expr> {
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
        Op::ToPartial { group, .. } => Expr::Binary(
            BinaryOp::Mul,
            i(0),
            Box::new(Expr::constant(1.0 / *group as f64)),
        ),
        Op::Full { value, .. } => Expr::constant(round_for(g.ty(n.outputs[0]).dtype, *value)),
        // Broadcasting one element is elementwise too.
        Op::Expand { .. } if g.ty(n.inputs[0]).numel() == 1 => Expr::Input(0),
        _ => return None,
    })
}

fn round_for(d: DType, x: f64) -> f64 {
    graphtrain_ir::interp::round_to_dtype(d, x)
}

/// The reduction a `reduce_sum` or `reduce_max` performs.
pub(crate) fn reduce_kind(op: &Op) -> ReduceKind {
    if matches!(op, Op::ReduceSum { .. }) {
        ReduceKind::Sum
    } else {
        ReduceKind::Max
    }
}
