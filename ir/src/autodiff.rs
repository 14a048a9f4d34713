//! Reverse-mode autodiff as a graph-to-graph transform: backward nodes are appended to the same
//! graph, one gradient rule per op, each tagged `bwd` with the module path of the forward node it
//! differentiates.
//!
//! Only nodes on a path from a differentiated input to the loss get rules applied; integer and
//! bool values never carry gradients. Composite ops get composite backward ops
//! (`attention` -> `attention_backward`, ...), so the lowering keeps its fused kernels for both
//! directions. Backward ops themselves are not differentiable (no second-order gradients yet);
//! asking for one is an error, not a silent zero.

use crate::dtype::TensorType;
use crate::graph::{Graph, Meta, Node, Phase, TypeError, ValueId};
use crate::mesh::Reduce;
use crate::op::{BinaryOp, Collective, CompareOp, Op, UnaryOp};
use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub enum AutodiffError {
    /// The value to differentiate is not a float scalar.
    LossNotScalar(TensorType),
    /// A node on the path from the parameters to the loss has no gradient rule.
    NotDifferentiable { op: &'static str, module: String },
    /// A rule built an ill-typed node: a bug in the rule.
    Rule(TypeError),
}

impl fmt::Display for AutodiffError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutodiffError::LossNotScalar(t) => {
                write!(f, "can only differentiate a float scalar, got {t}")
            }
            AutodiffError::NotDifferentiable { op, module } => write!(
                f,
                "`{op}` in `{module}` lies between the parameters and the loss but has no gradient rule"
            ),
            AutodiffError::Rule(e) => write!(f, "gradient rule built an ill-typed node: {e}"),
        }
    }
}

impl std::error::Error for AutodiffError {}

impl From<TypeError> for AutodiffError {
    fn from(e: TypeError) -> Self {
        AutodiffError::Rule(e)
    }
}

type Res<T> = Result<T, AutodiffError>;

/// Options for `grad_with`. The default applies every rule as written.
#[derive(Default)]
pub struct GradOptions<'a> {
    /// Test hook, so a test can prove that gradcheck catches a wrong rule: called after each rule
    /// with the input cotangents the rule produced, it returns the cotangents to use instead (the
    /// same ones to leave the rule alone), and may append nodes to the graph to compute them.
    /// `None`, the default, costs one branch per differentiated node and changes nothing.
    pub replace_rule: Option<RuleHook<'a>>,
    /// The cotangent the loss starts with (default 1). An SPMD train step, whose ranks each
    /// differentiate their local loss, starts at 1 / world size: the sum over ranks is then the
    /// gradient of the mean loss.
    pub seed: Option<f64>,
    /// Mesh dimensions (and the number of ranks along them) over which the loss is replicated
    /// but its cotangent starts partial: each rank starts at `seed / group` (`to_partial`), the
    /// convention under which the gradient of every replicated value is a partial sum.
    pub seed_partial: Option<(Vec<usize>, usize)>,
}

/// One application of a gradient rule, as `GradOptions::replace_rule` sees it.
pub struct RuleSite<'s> {
    /// Index of the forward node in `Graph::nodes`.
    pub index: usize,
    /// The forward node whose rule just ran.
    pub node: &'s Node,
    /// Cotangents of the node's outputs (`None` where none reached it).
    pub out_cots: &'s [Option<ValueId>],
    /// Which inputs want a cotangent.
    pub need: &'s [bool],
    /// The metadata the rule's backward nodes carry.
    pub meta: &'s Meta,
}

/// See `GradOptions::replace_rule`: `(graph, site, the rule's input cotangents)` to the input
/// cotangents to use.
pub type RuleHook<'a> = &'a dyn Fn(
    &mut Graph,
    &RuleSite<'_>,
    Vec<Option<ValueId>>,
) -> Result<Vec<Option<ValueId>>, TypeError>;

/// Appends the backward pass of `loss` to `g` and returns d loss / d `wrt[i]` for each `i`
/// (zeros where the loss does not depend on it).
pub fn grad(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Res<Vec<ValueId>> {
    grad_with(g, loss, wrt, &GradOptions::default())
}

pub fn grad_with(
    g: &mut Graph,
    loss: ValueId,
    wrt: &[ValueId],
    opts: &GradOptions<'_>,
) -> Res<Vec<ValueId>> {
    let loss_ty = g.ty(loss).clone();
    if loss_ty.rank() != 0 || !loss_ty.dtype.is_float() {
        return Err(AutodiffError::LossNotScalar(loss_ty));
    }
    let carries_grad = |g: &Graph, v: ValueId| g.ty(v).dtype.is_float();

    // depends[v]: v is a float value that depends on some `wrt`.
    let mut depends = vec![false; g.values.len()];
    for w in wrt {
        depends[w.index()] = carries_grad(g, *w);
    }
    for n in &g.nodes {
        if n.inputs.iter().any(|v| depends[v.index()]) {
            for o in &n.outputs {
                depends[o.index()] = carries_grad(g, *o);
            }
        }
    }
    let needed = g.needed_for(&[loss]);

    let mut cot: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let forward_len = g.nodes.len();
    let loss_module = g
        .producers()
        .get(loss.index())
        .copied()
        .flatten()
        .map(|i| g.nodes[i].meta.module.clone())
        .unwrap_or_default();
    if depends[loss.index()] {
        let mut cx = Ctx {
            g,
            meta: Meta::new(loss_module, Phase::Backward),
        };
        let mut one = cx.push(
            Op::Full {
                value: opts.seed.unwrap_or(1.0),
                shape: vec![],
                dtype: loss_ty.dtype,
            },
            vec![],
        )?;
        if let Some((mesh_dims, group)) = &opts.seed_partial {
            one = cx.push(
                Op::ToPartial {
                    mesh_dims: mesh_dims.clone(),
                    group: *group,
                },
                vec![one],
            )?;
        }
        cot[loss.index()] = Some(one);
    }

    for i in (0..forward_len).rev() {
        if !needed[i] {
            continue;
        }
        let node = g.nodes[i].clone();
        let out_cots: Vec<Option<ValueId>> = node.outputs.iter().map(|o| cot[o.index()]).collect();
        if out_cots.iter().all(Option::is_none) {
            continue;
        }
        let need: Vec<bool> = node.inputs.iter().map(|v| depends[v.index()]).collect();
        if !need.iter().any(|&b| b) {
            continue;
        }
        let mut cx = Ctx {
            g,
            meta: Meta {
                phase: Phase::Backward,
                ..node.meta.clone()
            },
        };
        let mut in_cots = rule(
            &mut cx,
            &node.op,
            &node.inputs,
            &node.outputs,
            &out_cots,
            &need,
        )?;
        if let Some(hook) = opts.replace_rule {
            let site = RuleSite {
                index: i,
                node: &node,
                out_cots: &out_cots,
                need: &need,
                meta: &cx.meta,
            };
            in_cots = hook(cx.g, &site, in_cots)?;
        }
        for ((v, c), needed) in node.inputs.iter().zip(in_cots).zip(&need) {
            let (Some(c), true) = (c, *needed) else {
                continue;
            };
            cot[v.index()] = Some(match cot[v.index()] {
                None => c,
                Some(prev) => cx.binary(BinaryOp::Add, prev, c)?,
            });
        }
    }

    let mut grads = Vec::with_capacity(wrt.len());
    for w in wrt {
        let gv = match cot[w.index()] {
            Some(c) => c,
            None => {
                let ty = g.ty(*w).clone();
                let mut cx = Ctx {
                    g,
                    meta: Meta::new("", Phase::Backward),
                };
                cx.full(0.0, &ty)?
            }
        };
        grads.push(gv);
    }
    Ok(grads)
}

/// Emits backward nodes with one metadata record.
struct Ctx<'g> {
    g: &'g mut Graph,
    meta: Meta,
}

impl Ctx<'_> {
    fn ty(&self, v: ValueId) -> TensorType {
        self.g.ty(v).clone()
    }
    fn shape(&self, v: ValueId) -> Vec<usize> {
        self.g.ty(v).shape.clone()
    }
    fn push_n(&mut self, op: Op, ins: Vec<ValueId>) -> Res<Vec<ValueId>> {
        Ok(self.g.push(op, ins, self.meta.clone())?)
    }
    fn push(&mut self, op: Op, ins: Vec<ValueId>) -> Res<ValueId> {
        Ok(self.push_n(op, ins)?[0])
    }
    fn unary(&mut self, u: UnaryOp, x: ValueId) -> Res<ValueId> {
        self.push(Op::Unary(u), vec![x])
    }
    fn binary(&mut self, b: BinaryOp, x: ValueId, y: ValueId) -> Res<ValueId> {
        self.push(Op::Binary(b), vec![x, y])
    }
    fn mul(&mut self, x: ValueId, y: ValueId) -> Res<ValueId> {
        self.binary(BinaryOp::Mul, x, y)
    }
    fn neg(&mut self, x: ValueId) -> Res<ValueId> {
        self.unary(UnaryOp::Neg, x)
    }
    fn mul_scalar(&mut self, x: ValueId, value: f64) -> Res<ValueId> {
        self.push(Op::MulScalar { value }, vec![x])
    }
    fn add_scalar(&mut self, x: ValueId, value: f64) -> Res<ValueId> {
        self.push(Op::AddScalar { value }, vec![x])
    }
    fn full(&mut self, value: f64, ty: &TensorType) -> Res<ValueId> {
        self.push(
            Op::Full {
                value,
                shape: ty.shape.clone(),
                dtype: ty.dtype,
            },
            vec![],
        )
    }
    /// `cond ? x : 0`, or `cond ? 0 : x` when `keep_when` is false.
    fn masked(&mut self, cond: ValueId, x: ValueId, keep_when: bool) -> Res<ValueId> {
        let zero = self.full(0.0, &self.ty(x))?;
        if keep_when {
            self.push(Op::Select, vec![cond, x, zero])
        } else {
            self.push(Op::Select, vec![cond, zero, x])
        }
    }
    /// Broadcasts `x`, reduced over `axes` of `shape` (with or without kept dims), back to `shape`.
    fn broadcast_back(&mut self, x: ValueId, axes: &[usize], shape: &[usize]) -> Res<ValueId> {
        let keep: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let x = if self.shape(x) != keep {
            self.push(Op::Reshape { shape: keep }, vec![x])?
        } else {
            x
        };
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.push(
            Op::Expand {
                shape: shape.to_vec(),
            },
            vec![x],
        )
    }
    fn transpose_last2(&mut self, x: ValueId) -> Res<ValueId> {
        let r = self.shape(x).len();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.push(Op::Transpose { perm }, vec![x])
    }
}

/// The gradient rule of `op`: input cotangents from output cotangents. `need[k]` says whether
/// input `k` wants one; rules may skip those that don't.
fn rule(
    cx: &mut Ctx<'_>,
    op: &Op,
    ins: &[ValueId],
    outs: &[ValueId],
    out_cots: &[Option<ValueId>],
    need: &[bool],
) -> Res<Vec<Option<ValueId>>> {
    let not_diff = || AutodiffError::NotDifferentiable {
        op: op.name(),
        module: cx.meta.module.clone(),
    };
    // Every differentiable op has one output.
    let gy = match out_cots {
        [Some(c)] => *c,
        _ => return Err(not_diff()),
    };
    let y = outs[0];
    let x = ins[0];
    let one = |v: ValueId| Ok(vec![Some(v)]);
    match op {
        Op::Unary(u) => {
            let gx = match u {
                // d(-x) = -1
                UnaryOp::Neg => cx.neg(gy)?,
                // d exp x = exp x
                UnaryOp::Exp => cx.mul(gy, y)?,
                // d log x = 1/x
                UnaryOp::Log => cx.binary(BinaryOp::Div, gy, x)?,
                // d sqrt x = 1 / (2 sqrt x)
                UnaryOp::Sqrt => {
                    let h = cx.mul_scalar(gy, 0.5)?;
                    cx.binary(BinaryOp::Div, h, y)?
                }
                // d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
                UnaryOp::Rsqrt => {
                    let y3 = cx.push(Op::PowScalar { exponent: 3.0 }, vec![y])?;
                    let d = cx.mul_scalar(y3, -0.5)?;
                    cx.mul(gy, d)?
                }
                // d 1/x = -1/x^2 = -y^2
                UnaryOp::Recip => {
                    let y2 = cx.unary(UnaryOp::Square, y)?;
                    let t = cx.mul(gy, y2)?;
                    cx.neg(t)?
                }
                // d sin x = cos x
                UnaryOp::Sin => {
                    let c = cx.unary(UnaryOp::Cos, x)?;
                    cx.mul(gy, c)?
                }
                // d cos x = -sin x
                UnaryOp::Cos => {
                    let s = cx.unary(UnaryOp::Sin, x)?;
                    let t = cx.mul(gy, s)?;
                    cx.neg(t)?
                }
                // d tanh x = 1 - y^2
                UnaryOp::Tanh => {
                    let y2 = cx.unary(UnaryOp::Square, y)?;
                    let n = cx.neg(y2)?;
                    let d = cx.add_scalar(n, 1.0)?;
                    cx.mul(gy, d)?
                }
                // d sigmoid x = y (1 - y)
                UnaryOp::Sigmoid => {
                    let n = cx.neg(y)?;
                    let omy = cx.add_scalar(n, 1.0)?;
                    let d = cx.mul(y, omy)?;
                    cx.mul(gy, d)?
                }
                // d x·s(x) = s(x) (1 + x (1 - s(x)))
                UnaryOp::Silu => {
                    let s = cx.unary(UnaryOp::Sigmoid, x)?;
                    let n = cx.neg(s)?;
                    let oms = cx.add_scalar(n, 1.0)?;
                    let xo = cx.mul(x, oms)?;
                    let t = cx.add_scalar(xo, 1.0)?;
                    let d = cx.mul(s, t)?;
                    cx.mul(gy, d)?
                }
                // d |x| = sign x (0 at 0)
                UnaryOp::Abs => {
                    let ty = cx.ty(x);
                    let zero = cx.full(0.0, &ty)?;
                    let pos = cx.push(Op::Compare(CompareOp::Gt), vec![x, zero])?;
                    let negm = cx.push(Op::Compare(CompareOp::Lt), vec![x, zero])?;
                    let ng = cx.neg(gy)?;
                    let t = cx.masked(negm, ng, true)?;
                    cx.push(Op::Select, vec![pos, gy, t])?
                }
                // d x^2 = 2x
                UnaryOp::Square => {
                    let d = cx.mul_scalar(x, 2.0)?;
                    cx.mul(gy, d)?
                }
            };
            one(gx)
        }
        // d (x + c) = 1
        Op::AddScalar { .. } => one(gy),
        // Moving a buffer between memories is the identity on values.
        Op::Offload | Op::Reload => one(gy),
        // d (x c) = c
        Op::MulScalar { value } => one(cx.mul_scalar(gy, *value)?),
        // d x^p = p x^(p-1)
        Op::PowScalar { exponent } => {
            let p = cx.push(
                Op::PowScalar {
                    exponent: exponent - 1.0,
                },
                vec![x],
            )?;
            let d = cx.mul_scalar(p, *exponent)?;
            one(cx.mul(gy, d)?)
        }
        Op::Binary(b) => {
            let (a, bb) = (ins[0], ins[1]);
            let (ga, gb) = match b {
                BinaryOp::Add => (Some(gy), Some(gy)),
                BinaryOp::Sub => (Some(gy), if need[1] { Some(cx.neg(gy)?) } else { None }),
                // d(ab) = b da + a db
                BinaryOp::Mul => (
                    if need[0] { Some(cx.mul(gy, bb)?) } else { None },
                    if need[1] { Some(cx.mul(gy, a)?) } else { None },
                ),
                // d(a/b) = da/b - (a/b) db/b
                BinaryOp::Div => {
                    let ga = if need[0] {
                        Some(cx.binary(BinaryOp::Div, gy, bb)?)
                    } else {
                        None
                    };
                    let gb = if need[1] {
                        let t = cx.mul(gy, y)?;
                        let t = cx.binary(BinaryOp::Div, t, bb)?;
                        Some(cx.neg(t)?)
                    } else {
                        None
                    };
                    (ga, gb)
                }
                // max/min route the gradient to the selected operand (ties go to `a`).
                BinaryOp::Max | BinaryOp::Min => {
                    let c = if *b == BinaryOp::Max {
                        CompareOp::Ge
                    } else {
                        CompareOp::Le
                    };
                    let pick_a = cx.push(Op::Compare(c), vec![a, bb])?;
                    (
                        if need[0] {
                            Some(cx.masked(pick_a, gy, true)?)
                        } else {
                            None
                        },
                        if need[1] {
                            Some(cx.masked(pick_a, gy, false)?)
                        } else {
                            None
                        },
                    )
                }
                // d a^b = b a^(b-1) da + a^b log(a) db
                BinaryOp::Pow => {
                    let ga = if need[0] {
                        let bm1 = cx.add_scalar(bb, -1.0)?;
                        let p = cx.binary(BinaryOp::Pow, a, bm1)?;
                        let d = cx.mul(bb, p)?;
                        Some(cx.mul(gy, d)?)
                    } else {
                        None
                    };
                    let gb = if need[1] {
                        let l = cx.unary(UnaryOp::Log, a)?;
                        let d = cx.mul(y, l)?;
                        Some(cx.mul(gy, d)?)
                    } else {
                        None
                    };
                    (ga, gb)
                }
            };
            Ok(vec![ga, gb])
        }
        Op::Select => {
            let c = ins[0];
            Ok(vec![
                None,
                if need[1] {
                    Some(cx.masked(c, gy, true)?)
                } else {
                    None
                },
                if need[2] {
                    Some(cx.masked(c, gy, false)?)
                } else {
                    None
                },
            ])
        }
        Op::Cast { .. } => {
            let from = cx.ty(x).dtype;
            if from.is_float() {
                one(cx.push(Op::Cast { dtype: from }, vec![gy])?)
            } else {
                Ok(vec![None])
            }
        }
        // Each input element feeds every output of its reduced group.
        Op::ReduceSum { axes, .. } => {
            let shape = cx.shape(x);
            one(cx.broadcast_back(gy, axes, &shape)?)
        }
        // The gradient goes to every element equal to the max.
        Op::ReduceMax { axes, .. } => {
            let shape = cx.shape(x);
            let yb = cx.broadcast_back(y, axes, &shape)?;
            let gb = cx.broadcast_back(gy, axes, &shape)?;
            let hit = cx.push(Op::Compare(CompareOp::Eq), vec![x, yb])?;
            one(cx.masked(hit, gb, true)?)
        }
        Op::Reshape { .. } => {
            let shape = cx.shape(x);
            one(cx.push(Op::Reshape { shape }, vec![gy])?)
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            one(cx.push(Op::Transpose { perm: inv }, vec![gy])?)
        }
        // Sum over the broadcast dims.
        Op::Expand { shape } => {
            let from = cx.shape(x);
            let axes: Vec<usize> = (0..from.len()).filter(|&i| from[i] != shape[i]).collect();
            if axes.is_empty() {
                return one(gy);
            }
            one(cx.push(
                Op::ReduceSum {
                    axes,
                    keepdim: true,
                },
                vec![gy],
            )?)
        }
        // Zero-pad back to the input's extent.
        Op::Slice { axis, start, end } => {
            let ty = cx.ty(x);
            let mut parts = Vec::new();
            if *start > 0 {
                let mut s = ty.shape.clone();
                s[*axis] = *start;
                parts.push(cx.full(0.0, &ty.with_shape(s))?);
            }
            parts.push(gy);
            if *end < ty.shape[*axis] {
                let mut s = ty.shape.clone();
                s[*axis] = ty.shape[*axis] - end;
                parts.push(cx.full(0.0, &ty.with_shape(s))?);
            }
            if parts.len() == 1 {
                return one(gy);
            }
            one(cx.push(Op::Concat { axis: *axis }, parts)?)
        }
        Op::Concat { axis } => {
            let mut off = 0;
            let mut out = Vec::with_capacity(ins.len());
            for (k, v) in ins.iter().enumerate() {
                let len = cx.shape(*v)[*axis];
                out.push(if need[k] {
                    Some(cx.push(
                        Op::Slice {
                            axis: *axis,
                            start: off,
                            end: off + len,
                        },
                        vec![gy],
                    )?)
                } else {
                    None
                });
                off += len;
            }
            Ok(out)
        }
        Op::Gather { axis } => {
            let zero = cx.full(0.0, &cx.ty(x))?;
            one(cx.push(Op::ScatterAdd { axis: *axis }, vec![zero, ins[1], gy])?)
        }
        Op::ScatterAdd { axis } => Ok(vec![
            Some(gy),
            None,
            if need[2] {
                Some(cx.push(Op::Gather { axis: *axis }, vec![gy, ins[1]])?)
            } else {
                None
            },
        ]),
        // d(AB) = dA Bᵀ + Aᵀ dB; a rank-2 B shared over the batch sums over it.
        Op::Matmul => {
            let (a, b) = (ins[0], ins[1]);
            let ga = if need[0] {
                let bt = cx.transpose_last2(b)?;
                Some(cx.push(Op::Matmul, vec![gy, bt])?)
            } else {
                None
            };
            let gb = if need[1] {
                let (ra, rb) = (cx.shape(a).len(), cx.shape(b).len());
                if ra == rb {
                    let at = cx.transpose_last2(a)?;
                    Some(cx.push(Op::Matmul, vec![at, gy])?)
                } else {
                    let sa = cx.shape(a);
                    let sg = cx.shape(gy);
                    let k = sa[ra - 1];
                    let n = sg[sg.len() - 1];
                    let rows: usize = sa[..ra - 1].iter().product();
                    let a2 = cx.push(
                        Op::Reshape {
                            shape: vec![rows, k],
                        },
                        vec![a],
                    )?;
                    let g2 = cx.push(
                        Op::Reshape {
                            shape: vec![rows, n],
                        },
                        vec![gy],
                    )?;
                    let at = cx.push(Op::Transpose { perm: vec![1, 0] }, vec![a2])?;
                    Some(cx.push(Op::Matmul, vec![at, g2])?)
                }
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
        Op::Embedding => {
            let rows = cx.shape(x)[0];
            Ok(vec![
                Some(cx.push(Op::EmbeddingBackward { rows }, vec![gy, ins[1]])?),
                None,
            ])
        }
        // Linear in the incoming gradient: its adjoint is the row gather.
        Op::EmbeddingBackward { .. } => {
            Ok(vec![Some(cx.push(Op::Embedding, vec![gy, ins[1]])?), None])
        }
        Op::RmsNorm { eps } => {
            let r = cx.push_n(Op::RmsNormBackward { eps: *eps }, vec![ins[0], ins[1], gy])?;
            Ok(vec![Some(r[0]), Some(r[1])])
        }
        // A rotation's adjoint is the opposite rotation.
        Op::Rope {
            theta,
            layout,
            inverse,
        } => one(cx.push(
            Op::Rope {
                theta: *theta,
                layout: *layout,
                inverse: !inverse,
            },
            vec![gy],
        )?),
        // The statistics form (`stats`, two outputs) never gets here: it is made after
        // autodiff, by `attention_stats`, and is refused above as not differentiable.
        Op::Attention { causal, scale, .. } => {
            let r = cx.push_n(
                Op::AttentionBackward {
                    causal: *causal,
                    scale: *scale,
                    stats: false,
                },
                vec![ins[0], ins[1], ins[2], gy],
            )?;
            Ok(vec![Some(r[0]), Some(r[1]), Some(r[2])])
        }
        // dx = y (g - Σ g y)
        Op::Softmax { axis } => {
            let shape = cx.shape(y);
            let gyy = cx.mul(gy, y)?;
            let s = cx.push(
                Op::ReduceSum {
                    axes: vec![*axis],
                    keepdim: true,
                },
                vec![gyy],
            )?;
            let s = cx.broadcast_back(s, &[*axis], &shape)?;
            let d = cx.binary(BinaryOp::Sub, gy, s)?;
            one(cx.mul(y, d)?)
        }
        // dx = g - exp(y) Σ g
        Op::LogSoftmax { axis } => {
            let shape = cx.shape(y);
            let s = cx.push(
                Op::ReduceSum {
                    axes: vec![*axis],
                    keepdim: true,
                },
                vec![gy],
            )?;
            let s = cx.broadcast_back(s, &[*axis], &shape)?;
            let p = cx.unary(UnaryOp::Exp, y)?;
            let t = cx.mul(p, s)?;
            one(cx.binary(BinaryOp::Sub, gy, t)?)
        }
        Op::CrossEntropy => Ok(vec![
            Some(cx.push(Op::CrossEntropyBackward, vec![ins[0], ins[1], gy])?),
            None,
        ]),
        Op::Compare(_)
        | Op::Full { .. }
        | Op::Iota { .. }
        | Op::RandomUniform { .. }
        | Op::RandomNormal { .. } => Ok(vec![None; ins.len()]),
        Op::RmsNormBackward { .. }
        | Op::AttentionBackward { .. }
        | Op::CrossEntropyBackward
        | Op::AdamW { .. }
        | Op::Sgd { .. } => Err(not_diff()),
        // The handle carries the result: waiting is the identity on values.
        Op::Wait => one(gy),
        // The gradient of the partial result is replicated; the input's is partial again:
        // each rank's share `gy / group` sums to `gy`.
        Op::ToPartial { mesh_dims, group } => one(cx.push(
            Op::ToPartial {
                mesh_dims: mesh_dims.clone(),
                group: *group,
            },
            vec![gy],
        )?),
        // Over the ranks of a group, all-gather and reduce-scatter(sum) are each other's
        // adjoint, all-reduce(sum) is its own, and an average scales by 1/n on the way back.
        Op::CollectiveStart {
            collective,
            mesh_dims,
            group,
        } => {
            let n = *group as f64;
            let start = |cx: &mut Ctx<'_>, c: Collective, v: ValueId| -> Res<ValueId> {
                let handle = cx.push(
                    Op::CollectiveStart {
                        collective: c,
                        mesh_dims: mesh_dims.clone(),
                        group: *group,
                    },
                    vec![v],
                )?;
                cx.push(Op::Wait, vec![handle])
            };
            let gx = match *collective {
                Collective::AllGather { axis } => start(
                    cx,
                    Collective::ReduceScatter {
                        axis,
                        reduce: Reduce::Sum,
                    },
                    gy,
                )?,
                Collective::ReduceScatter { axis, reduce } => {
                    let g = start(cx, Collective::AllGather { axis }, gy)?;
                    match reduce {
                        Reduce::Sum => g,
                        Reduce::Avg => cx.mul_scalar(g, 1.0 / n)?,
                    }
                }
                Collective::AllReduce { reduce } => {
                    let g = start(
                        cx,
                        Collective::AllReduce {
                            reduce: Reduce::Sum,
                        },
                        gy,
                    )?;
                    match reduce {
                        Reduce::Sum => g,
                        Reduce::Avg => cx.mul_scalar(g, 1.0 / n)?,
                    }
                }
                // Block j of member i went to member j's block i: the reverse exchange.
                Collective::AllToAll {
                    split_axis,
                    concat_axis,
                } => start(
                    cx,
                    Collective::AllToAll {
                        split_axis: concat_axis,
                        concat_axis: split_axis,
                    },
                    gy,
                )?,
                // The root would get the group's sum and the others nothing; no rule yet, so
                // refused rather than a silent zero.
                Collective::Broadcast { .. } => {
                    return Err(AutodiffError::NotDifferentiable {
                        op: "broadcast_start",
                        module: cx.meta.module.clone(),
                    })
                }
            };
            one(gx)
        }
    }
}
