//! Decompositions: every composite op rewritten as primitives (possibly via other composites,
//! which `decompose` expands in turn), for backends without a kernel and for checking fused
//! kernels against a plain composition.
//!
//! Guarantees:
//! - `decompose_op` emits nodes whose outputs have exactly the composite's output types (checked,
//!   with a `TypeError` otherwise), and every emitted node carries the composite's `Meta`;
//! - the rewrites compute the same math as the interpreter's kernels, in an order close enough
//!   that f64 results agree to about 1e-12 (the tests hold them to 1e-10);
//! - out-of-range ids and targets still fail: embeddings and cross-entropy go through
//!   `gather` / `scatter_add`, which check their indices.

use crate::dtype::{DType, TensorType};
use crate::graph::{Graph, Meta, TypeError, ValueId};
use crate::infer::infer_types;
use crate::op::{BinaryOp, CompareOp, Op, RopeLayout, UnaryOp};

/// Appends to `g` primitive nodes computing `op` applied to `inputs` (meta copied onto every new
/// node) and returns the output values. A primitive op is appended as it is. The emitted nodes may
/// include simpler composites (attention emits softmax); `decompose` expands those too.
pub fn decompose_op(
    g: &mut Graph,
    op: &Op,
    inputs: &[ValueId],
    meta: &Meta,
) -> Result<Vec<ValueId>, TypeError> {
    let operand_types: Vec<TensorType> = inputs.iter().map(|v| g.ty(*v).clone()).collect();
    // Inferring first gives composites the same arity and type errors as `Graph::push`, so the
    // rewrites below may index `inputs` and rely on the shape relations.
    let want = infer_types(op, &operand_types).map_err(|message| TypeError {
        op: op.name(),
        module: meta.module.clone(),
        operands: operand_types.clone(),
        message,
    })?;
    let mut e = Emit { g, meta };
    let outs = match op {
        Op::Embedding => vec![embedding(&mut e, inputs[0], inputs[1])?],
        Op::EmbeddingBackward { rows } => {
            vec![embedding_backward(&mut e, inputs[0], inputs[1], *rows)?]
        }
        Op::RmsNorm { eps } => vec![rms_norm(&mut e, inputs[0], inputs[1], *eps)?],
        Op::RmsNormBackward { eps } => {
            rms_norm_backward(&mut e, inputs[0], inputs[1], inputs[2], *eps)?
        }
        Op::Rope {
            theta,
            layout,
            inverse,
        } => vec![rope(&mut e, inputs[0], *theta, *layout, *inverse)?],
        Op::Attention {
            causal,
            scale,
            stats,
        } => attention(
            &mut e, inputs[0], inputs[1], inputs[2], *causal, *scale, *stats,
        )?,
        Op::AttentionBackward {
            causal,
            scale,
            stats,
        } => {
            let (q, k, v, dout) = (inputs[0], inputs[1], inputs[2], inputs[3]);
            let stats = stats.then(|| inputs[4]);
            attention_backward(&mut e, q, k, v, dout, stats, *causal, *scale)?
        }
        Op::Softmax { axis } => vec![softmax(&mut e, inputs[0], *axis, false)?],
        Op::LogSoftmax { axis } => vec![softmax(&mut e, inputs[0], *axis, true)?],
        Op::CrossEntropy => vec![cross_entropy(&mut e, inputs[0], inputs[1])?],
        Op::CrossEntropyBackward => vec![cross_entropy_backward(
            &mut e, inputs[0], inputs[1], inputs[2],
        )?],
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => adamw(&mut e, inputs, *beta1, *beta2, *eps, *weight_decay)?,
        Op::Sgd { weight_decay } => {
            vec![sgd(&mut e, inputs[0], inputs[1], inputs[2], *weight_decay)?]
        }
        primitive => e.g.push(primitive.clone(), inputs.to_vec(), meta.clone())?,
    };
    let got: Vec<TensorType> = outs.iter().map(|v| g.ty(*v).clone()).collect();
    if got != want {
        return Err(TypeError {
            op: op.name(),
            module: meta.module.clone(),
            operands: operand_types,
            message: format!(
                "internal error: the decomposition produced {got:?}, the op has type {want:?}"
            ),
        });
    }
    Ok(outs)
}

/// Each pass expands one level of composites; the deepest chain is attention -> softmax (and
/// cross-entropy -> log-softmax), so this bound is only reached by a decomposition that re-emits
/// what it expands.
const MAX_PASSES: usize = 8;

/// A copy of `g` where every composite node with `pick(&node.op)` true is replaced by its
/// decomposition, recursively until none of the picked ops remain; values are remapped, inputs
/// and outputs (with their donations) preserved. The result is canonical.
pub fn decompose(g: &Graph, pick: &dyn Fn(&Op) -> bool) -> Result<Graph, TypeError> {
    let picked = |op: &Op| op.is_composite() && pick(op);
    let mut current = g.clone();
    for _ in 0..MAX_PASSES {
        if !current.nodes.iter().any(|n| picked(&n.op)) {
            return Ok(current.canonical());
        }
        current = expand_once(&current, &picked)?;
    }
    let stuck = current.nodes.iter().find(|n| picked(&n.op));
    Err(TypeError {
        op: stuck.map_or("", |n| n.op.name()),
        module: stuck.map_or(String::new(), |n| n.meta.module.clone()),
        operands: Vec::new(),
        message: format!("composites remain after {MAX_PASSES} decomposition passes"),
    })
}

/// One pass: picked nodes become their decomposition, the others are copied.
fn expand_once(g: &Graph, picked: &dyn Fn(&Op) -> bool) -> Result<Graph, TypeError> {
    let mut out = Graph::new(g.name.clone());
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let undefined = |v: ValueId, op: &'static str, module: &str| TypeError {
        op,
        module: module.to_string(),
        operands: Vec::new(),
        message: format!("reads %{} before anything defines it", v.index()),
    };
    for input in &g.inputs {
        let ty = g
            .values
            .get(input.value.index())
            .cloned()
            .ok_or_else(|| undefined(input.value, "input", ""))?;
        map[input.value.index()] = Some(out.add_input(input.name.clone(), input.kind, ty));
    }
    let lookup = |map: &[Option<ValueId>], v: ValueId| map.get(v.index()).copied().flatten();
    for node in &g.nodes {
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            ins.push(
                lookup(&map, v).ok_or_else(|| undefined(v, node.op.name(), &node.meta.module))?,
            );
        }
        let outs = if picked(&node.op) {
            decompose_op(&mut out, &node.op, &ins, &node.meta)?
        } else {
            out.push(node.op.clone(), ins, node.meta.clone())?
        };
        for (old, new) in node.outputs.iter().zip(outs) {
            if let Some(slot) = map.get_mut(old.index()) {
                *slot = Some(new);
            }
        }
    }
    for o in &g.outputs {
        let value = lookup(&map, o.value).ok_or_else(|| undefined(o.value, "output", &o.name))?;
        let donates = match o.donates {
            Some(d) => Some(lookup(&map, d).ok_or_else(|| undefined(d, "output", &o.name))?),
            None => None,
        };
        out.add_output(o.name.clone(), value, donates);
    }
    out.keep_distribution_of(g);
    Ok(out)
}

/// Appends nodes with one `Meta`; short names keep the rewrites readable.
struct Emit<'a> {
    g: &'a mut Graph,
    meta: &'a Meta,
}

type R = Result<ValueId, TypeError>;

impl Emit<'_> {
    fn op(&mut self, op: Op, inputs: Vec<ValueId>) -> R {
        self.g.push1(op, inputs, self.meta.clone())
    }

    fn shape(&self, v: ValueId) -> Vec<usize> {
        self.g.ty(v).shape.clone()
    }

    fn dtype(&self, v: ValueId) -> DType {
        self.g.ty(v).dtype
    }

    fn unary(&mut self, u: UnaryOp, x: ValueId) -> R {
        self.op(Op::Unary(u), vec![x])
    }

    fn binary(&mut self, b: BinaryOp, x: ValueId, y: ValueId) -> R {
        self.op(Op::Binary(b), vec![x, y])
    }

    fn add(&mut self, x: ValueId, y: ValueId) -> R {
        self.binary(BinaryOp::Add, x, y)
    }

    fn sub(&mut self, x: ValueId, y: ValueId) -> R {
        self.binary(BinaryOp::Sub, x, y)
    }

    fn mul(&mut self, x: ValueId, y: ValueId) -> R {
        self.binary(BinaryOp::Mul, x, y)
    }

    fn div(&mut self, x: ValueId, y: ValueId) -> R {
        self.binary(BinaryOp::Div, x, y)
    }

    fn mul_scalar(&mut self, x: ValueId, value: f64) -> R {
        self.op(Op::MulScalar { value }, vec![x])
    }

    fn add_scalar(&mut self, x: ValueId, value: f64) -> R {
        self.op(Op::AddScalar { value }, vec![x])
    }

    fn cast(&mut self, x: ValueId, dtype: DType) -> R {
        if self.dtype(x) == dtype {
            return Ok(x);
        }
        self.op(Op::Cast { dtype }, vec![x])
    }

    fn reshape(&mut self, x: ValueId, shape: Vec<usize>) -> R {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.op(Op::Reshape { shape }, vec![x])
    }

    fn expand(&mut self, x: ValueId, shape: Vec<usize>) -> R {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.op(Op::Expand { shape }, vec![x])
    }

    /// Broadcasts `x` to `shape`, aligning trailing dims as numpy does: missing leading dims
    /// become 1, then size-1 dims expand.
    fn broadcast(&mut self, x: ValueId, shape: &[usize]) -> R {
        let xs = self.shape(x);
        let mut padded = vec![1; shape.len().saturating_sub(xs.len())];
        padded.extend(xs);
        let x = self.reshape(x, padded)?;
        self.expand(x, shape.to_vec())
    }

    fn transpose(&mut self, x: ValueId, perm: Vec<usize>) -> R {
        self.op(Op::Transpose { perm }, vec![x])
    }

    /// Swaps the last two axes of a rank-4 tensor.
    fn transpose_last(&mut self, x: ValueId) -> R {
        self.transpose(x, vec![0, 1, 3, 2])
    }

    fn reduce_sum(&mut self, x: ValueId, axes: Vec<usize>, keepdim: bool) -> R {
        if axes.is_empty() {
            return Ok(x);
        }
        self.op(Op::ReduceSum { axes, keepdim }, vec![x])
    }

    fn slice(&mut self, x: ValueId, axis: usize, start: usize, end: usize) -> R {
        self.op(Op::Slice { axis, start, end }, vec![x])
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

    fn iota(&mut self, shape: Vec<usize>, axis: usize, dtype: DType) -> R {
        self.op(Op::Iota { shape, axis, dtype }, vec![])
    }

    fn matmul(&mut self, x: ValueId, y: ValueId) -> R {
        self.op(Op::Matmul, vec![x, y])
    }

    /// Sum of `x` over `axis`, kept as size 1 and expanded back to `x`'s shape.
    fn sum_back(&mut self, x: ValueId, axis: usize) -> R {
        let shape = self.shape(x);
        let s = self.reduce_sum(x, vec![axis], true)?;
        self.expand(s, shape)
    }

    /// `ids` (any shape, N elements) as an `[N, width]` gather/scatter index selecting row
    /// `ids[n]` in every column.
    fn row_index(&mut self, ids: ValueId, width: usize) -> R {
        let n = self.g.ty(ids).numel();
        let col = self.reshape(ids, vec![n, 1])?;
        self.expand(col, vec![n, width])
    }
}

fn embedding(e: &mut Emit, w: ValueId, ids: ValueId) -> R {
    let d = e.shape(w)[1];
    let idx = e.row_index(ids, d)?;
    let rows = e.op(Op::Gather { axis: 0 }, vec![w, idx])?;
    let mut shape = e.shape(ids);
    shape.push(d);
    e.reshape(rows, shape)
}

fn embedding_backward(e: &mut Emit, grad: ValueId, ids: ValueId, rows: usize) -> R {
    let gs = e.shape(grad);
    let d = gs[gs.len() - 1];
    let n = e.g.ty(ids).numel();
    let flat = e.reshape(grad, vec![n, d])?;
    let idx = e.row_index(ids, d)?;
    let zeros = e.full(0.0, vec![rows, d], e.dtype(grad))?;
    e.op(Op::ScatterAdd { axis: 0 }, vec![zeros, idx, flat])
}

/// `(r, xhat)` of RMS normalization over the last axis: `r = 1/sqrt(mean(x²) + eps)` expanded to
/// `x`'s shape, `xhat = x * r`.
fn rms_parts(e: &mut Emit, x: ValueId, eps: f64) -> Result<(ValueId, ValueId), TypeError> {
    let shape = e.shape(x);
    let last = shape.len() - 1;
    let sq = e.unary(UnaryOp::Square, x)?;
    let ss = e.reduce_sum(sq, vec![last], true)?;
    let ms = e.mul_scalar(ss, 1.0 / shape[last] as f64)?;
    let shifted = e.add_scalar(ms, eps)?;
    let r = e.unary(UnaryOp::Rsqrt, shifted)?;
    let r = e.expand(r, shape)?;
    let xhat = e.mul(x, r)?;
    Ok((r, xhat))
}

fn rms_norm(e: &mut Emit, x: ValueId, w: ValueId, eps: f64) -> R {
    let shape = e.shape(x);
    let (_, xhat) = rms_parts(e, x, eps)?;
    let w = e.broadcast(w, &shape)?;
    e.mul(xhat, w)
}

fn rms_norm_backward(
    e: &mut Emit,
    x: ValueId,
    w: ValueId,
    gy: ValueId,
    eps: f64,
) -> Result<Vec<ValueId>, TypeError> {
    let shape = e.shape(x);
    let last = shape.len() - 1;
    let (r, xhat) = rms_parts(e, x, eps)?;
    let we = e.broadcast(w, &shape)?;
    let gyw = e.mul(gy, we)?;
    // gw sums gy * xhat over every leading dim.
    let gy_xhat = e.mul(gy, xhat)?;
    let gw = e.reduce_sum(gy_xhat, (0..last).collect(), false)?;
    // gx = r * (gy*w - xhat * mean(gy*w*xhat)).
    let proj = e.mul(gyw, xhat)?;
    let proj = e.reduce_sum(proj, vec![last], true)?;
    let mean = e.mul_scalar(proj, 1.0 / shape[last] as f64)?;
    let mean = e.expand(mean, shape)?;
    let along = e.mul(xhat, mean)?;
    let diff = e.sub(gyw, along)?;
    let gx = e.mul(r, diff)?;
    Ok(vec![gx, gw])
}

fn rope(e: &mut Emit, x: ValueId, theta: f64, layout: RopeLayout, inverse: bool) -> R {
    let shape = e.shape(x);
    let (b, s, h, d) = (shape[0], shape[1], shape[2], shape[3]);
    let half = d / 2;
    // The angle table is built in f64 and cast once, as a backend precomputes it, so an f32 or
    // bf16 graph does not accumulate rounding in the frequencies.
    let i = e.iota(vec![half], 0, DType::F64)?;
    let exponent = e.mul_scalar(i, -2.0 / d as f64)?;
    let base = e.full(theta, vec![half], DType::F64)?;
    let freq = e.binary(BinaryOp::Pow, base, exponent)?;
    let freq = e.broadcast(freq, &[s, half])?;
    let pos = e.iota(vec![s, half], 0, DType::F64)?;
    let mut angle = e.mul(pos, freq)?;
    if inverse {
        angle = e.unary(UnaryOp::Neg, angle)?;
    }
    let cos = e.unary(UnaryOp::Cos, angle)?;
    let sin = e.unary(UnaryOp::Sin, angle)?;
    let dtype = e.dtype(x);
    let cos = e.cast(cos, dtype)?;
    let sin = e.cast(sin, dtype)?;

    // Both layouts become "pairs along the last axis": Half splits D into two halves, Interleaved
    // views D as [D/2, 2] and splits the trailing 2.
    let (xv, table_shape, pair_shape, axis) = match layout {
        RopeLayout::Half => (x, vec![1, s, 1, half], vec![b, s, h, half], 3),
        RopeLayout::Interleaved => {
            let xv = e.reshape(x, vec![b, s, h, half, 2])?;
            (xv, vec![1, s, 1, half, 1], vec![b, s, h, half, 1], 4)
        }
    };
    let width = e.shape(xv)[axis] / 2;
    let x1 = e.slice(xv, axis, 0, width)?;
    let x2 = e.slice(xv, axis, width, 2 * width)?;
    let cos = e.reshape(cos, table_shape.clone())?;
    let cos = e.expand(cos, pair_shape.clone())?;
    let sin = e.reshape(sin, table_shape)?;
    let sin = e.expand(sin, pair_shape)?;
    let x1c = e.mul(x1, cos)?;
    let x2s = e.mul(x2, sin)?;
    let y1 = e.sub(x1c, x2s)?;
    let x1s = e.mul(x1, sin)?;
    let x2c = e.mul(x2, cos)?;
    let y2 = e.add(x1s, x2c)?;
    let y = e.op(Op::Concat { axis }, vec![y1, y2])?;
    e.reshape(y, shape)
}

/// k or v `[B, Hkv, S, D]` repeated to `hq` heads so that head `h` holds kv head `h / group`.
fn repeat_kv(e: &mut Emit, kv: ValueId, hq: usize) -> R {
    let ks = e.shape(kv);
    let (b, hkv, s, d) = (ks[0], ks[1], ks[2], ks[3]);
    if hkv == hq {
        return Ok(kv);
    }
    let group = hq / hkv;
    let split = e.reshape(kv, vec![b, hkv, 1, s, d])?;
    let rep = e.expand(split, vec![b, hkv, group, s, d])?;
    e.reshape(rep, vec![b, hq, s, d])
}

/// The reverse of `repeat_kv` for gradients: sums the query heads of each group.
fn sum_groups(e: &mut Emit, x: ValueId, hkv: usize) -> R {
    let xs = e.shape(x);
    let (b, hq, s, d) = (xs[0], xs[1], xs[2], xs[3]);
    if hkv == hq {
        return Ok(x);
    }
    let split = e.reshape(x, vec![b, hkv, hq / hkv, s, d])?;
    e.reduce_sum(split, vec![2], false)
}

/// Attention scores `q kᵀ * scale + mask`, `[B, Hq, S, S]`.
fn attention_scores(e: &mut Emit, q: ValueId, ke: ValueId, causal: bool, scale: f64) -> R {
    let kt = e.transpose_last(ke)?;
    let raw = e.matmul(q, kt)?;
    let mut scores = e.mul_scalar(raw, scale)?;
    if causal {
        let shape = e.shape(scores);
        let s = shape[2];
        let i = e.iota(vec![s, s], 0, DType::I64)?;
        let j = e.iota(vec![s, s], 1, DType::I64)?;
        let future = e.op(Op::Compare(CompareOp::Gt), vec![j, i])?;
        let future = e.broadcast(future, &shape)?;
        let ninf = e.full(f64::NEG_INFINITY, shape, e.dtype(scores))?;
        scores = e.op(Op::Select, vec![future, ninf, scores])?;
    }
    Ok(scores)
}

/// Attention probabilities `softmax(q kᵀ * scale + mask)`, `[B, Hq, S, S]`.
fn attention_probs(e: &mut Emit, q: ValueId, ke: ValueId, causal: bool, scale: f64) -> R {
    let scores = attention_scores(e, q, ke, causal, scale)?;
    // Kept composite, so a backend with a softmax kernel but no attention kernel still uses it.
    e.op(Op::Softmax { axis: 3 }, vec![scores])
}

/// The probabilities and their row statistics `[B, Hq, S, 2]` (max, sum of exponentials),
/// the softmax spelled out so that its max and sum are values.
fn attention_probs_and_stats(
    e: &mut Emit,
    q: ValueId,
    ke: ValueId,
    causal: bool,
    scale: f64,
) -> Result<(ValueId, ValueId), TypeError> {
    let scores = attention_scores(e, q, ke, causal, scale)?;
    let shape = e.shape(scores);
    let (max, _, exp) = shifted_exp(e, scores, 3)?;
    let sum = e.reduce_sum(exp, vec![3], true)?;
    let wide_sum = e.expand(sum, shape)?;
    let p = e.div(exp, wide_sum)?;
    let stats = e.op(Op::Concat { axis: 3 }, vec![max, sum])?;
    let stats_dtype = crate::infer::attention_stats_type(e.g.ty(q)).dtype;
    Ok((p, e.cast(stats, stats_dtype)?))
}

/// The probabilities from the forward's row statistics: `exp(scores - max) / sum`.
fn attention_probs_from(
    e: &mut Emit,
    q: ValueId,
    ke: ValueId,
    stats: ValueId,
    causal: bool,
    scale: f64,
) -> R {
    let scores = attention_scores(e, q, ke, causal, scale)?;
    let (shape, dtype) = (e.shape(scores), e.dtype(scores));
    let max = e.slice(stats, 3, 0, 1)?;
    let max = e.cast(max, dtype)?;
    let max = e.expand(max, shape.clone())?;
    let sum = e.slice(stats, 3, 1, 2)?;
    let sum = e.cast(sum, dtype)?;
    let sum = e.expand(sum, shape)?;
    let shifted = e.sub(scores, max)?;
    let exp = e.unary(UnaryOp::Exp, shifted)?;
    e.div(exp, sum)
}

fn attention(
    e: &mut Emit,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    causal: bool,
    scale: f64,
    stats: bool,
) -> Result<Vec<ValueId>, TypeError> {
    let hq = e.shape(q)[1];
    let ke = repeat_kv(e, k, hq)?;
    let ve = repeat_kv(e, v, hq)?;
    if stats {
        let (p, stats) = attention_probs_and_stats(e, q, ke, causal, scale)?;
        Ok(vec![e.matmul(p, ve)?, stats])
    } else {
        let p = attention_probs(e, q, ke, causal, scale)?;
        Ok(vec![e.matmul(p, ve)?])
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_backward(
    e: &mut Emit,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    dout: ValueId,
    stats: Option<ValueId>,
    causal: bool,
    scale: f64,
) -> Result<Vec<ValueId>, TypeError> {
    let hq = e.shape(q)[1];
    let hkv = e.shape(k)[1];
    let ke = repeat_kv(e, k, hq)?;
    let ve = repeat_kv(e, v, hq)?;
    let p = match stats {
        Some(stats) => attention_probs_from(e, q, ke, stats, causal, scale)?,
        None => attention_probs(e, q, ke, causal, scale)?,
    };
    // dv = pᵀ dout
    let pt = e.transpose_last(p)?;
    let dv = e.matmul(pt, dout)?;
    let dv = sum_groups(e, dv, hkv)?;
    // ds = p * (dp - rowsum(p * dp)), dp = dout vᵀ
    let vt = e.transpose_last(ve)?;
    let dp = e.matmul(dout, vt)?;
    let pdp = e.mul(p, dp)?;
    let t = e.sum_back(pdp, 3)?;
    let centered = e.sub(dp, t)?;
    let ds = e.mul(p, centered)?;
    // dq = scale * ds k, dk = scale * dsᵀ q
    let dq = e.matmul(ds, ke)?;
    let dq = e.mul_scalar(dq, scale)?;
    let dst = e.transpose_last(ds)?;
    let dk = e.matmul(dst, q)?;
    let dk = e.mul_scalar(dk, scale)?;
    let dk = sum_groups(e, dk, hkv)?;
    Ok(vec![dq, dk, dv])
}

/// A softmax's first steps along `axis`: the max (kept as size 1), `x - max` and its `exp`.
fn shifted_exp(
    e: &mut Emit,
    x: ValueId,
    axis: usize,
) -> Result<(ValueId, ValueId, ValueId), TypeError> {
    let shape = e.shape(x);
    let max = e.op(
        Op::ReduceMax {
            axes: vec![axis],
            keepdim: true,
        },
        vec![x],
    )?;
    let wide_max = e.expand(max, shape)?;
    let shifted = e.sub(x, wide_max)?;
    let exp = e.unary(UnaryOp::Exp, shifted)?;
    Ok((max, shifted, exp))
}

fn softmax(e: &mut Emit, x: ValueId, axis: usize, log: bool) -> R {
    let shape = e.shape(x);
    let (_, shifted, exp) = shifted_exp(e, x, axis)?;
    if log {
        // The log of each row's sum, then broadcast: one log per row, not per element.
        let sum = e.reduce_sum(exp, vec![axis], true)?;
        let log_sum = e.unary(UnaryOp::Log, sum)?;
        let log_sum = e.expand(log_sum, shape)?;
        e.sub(shifted, log_sum)
    } else {
        let sum = e.sum_back(exp, axis)?;
        e.div(exp, sum)
    }
}

fn cross_entropy(e: &mut Emit, logits: ValueId, targets: ValueId) -> R {
    let n = e.shape(logits)[0];
    let logp = e.op(Op::LogSoftmax { axis: 1 }, vec![logits])?;
    let idx = e.reshape(targets, vec![n, 1])?;
    let picked = e.op(Op::Gather { axis: 1 }, vec![logp, idx])?;
    let total = e.reduce_sum(picked, vec![0, 1], false)?;
    e.mul_scalar(total, -1.0 / n as f64)
}

fn cross_entropy_backward(e: &mut Emit, logits: ValueId, targets: ValueId, grad: ValueId) -> R {
    let shape = e.shape(logits);
    let (n, dtype) = (shape[0], e.dtype(logits));
    let p = e.op(Op::Softmax { axis: 1 }, vec![logits])?;
    // The one-hot is a scatter rather than a comparison so that a bad target is an error here too.
    let zeros = e.full(0.0, shape.clone(), dtype)?;
    let idx = e.reshape(targets, vec![n, 1])?;
    let ones = e.full(1.0, vec![n, 1], dtype)?;
    let onehot = e.op(Op::ScatterAdd { axis: 1 }, vec![zeros, idx, ones])?;
    let diff = e.sub(p, onehot)?;
    let g = e.broadcast(grad, &shape)?;
    let scaled = e.mul(diff, g)?;
    e.mul_scalar(scaled, 1.0 / n as f64)
}

/// `1 - base^t` for a scalar `t` of dtype `dtype`.
fn bias_correction(e: &mut Emit, base: f64, t: ValueId, dtype: DType) -> R {
    let b = e.full(base, vec![], dtype)?;
    let pow = e.binary(BinaryOp::Pow, b, t)?;
    let neg = e.mul_scalar(pow, -1.0)?;
    e.add_scalar(neg, 1.0)
}

fn adamw(
    e: &mut Emit,
    ins: &[ValueId],
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
) -> Result<Vec<ValueId>, TypeError> {
    let (p, g, m, v, lr, step) = (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]);
    let shape = e.shape(p);
    let pd = e.dtype(p);

    // Moments at their own dtypes.
    let gm = e.cast(g, e.dtype(m))?;
    let m_decayed = e.mul_scalar(m, b1)?;
    let g_part = e.mul_scalar(gm, 1.0 - b1)?;
    let m1 = e.add(m_decayed, g_part)?;
    let gv = e.cast(g, e.dtype(v))?;
    let v_decayed = e.mul_scalar(v, b2)?;
    let g2 = e.unary(UnaryOp::Square, gv)?;
    let g2_part = e.mul_scalar(g2, 1.0 - b2)?;
    let v1 = e.add(v_decayed, g2_part)?;

    // Scalars at the parameter's dtype, broadcast once each.
    let lr = e.cast(lr, pd)?;
    let t = e.cast(step, pd)?;
    let bc1 = bias_correction(e, b1, t, pd)?;
    let bc2 = bias_correction(e, b2, t, pd)?;
    let sqrt_bc2 = e.unary(UnaryOp::Sqrt, bc2)?;
    let lr_wd = e.mul_scalar(lr, -wd)?;
    let decay = e.add_scalar(lr_wd, 1.0)?;
    let step_size = e.div(lr, bc1)?;
    let decay = e.broadcast(decay, &shape)?;
    let sqrt_bc2 = e.broadcast(sqrt_bc2, &shape)?;
    let step_size = e.broadcast(step_size, &shape)?;

    // p' = p * (1 - lr*wd) - (lr/bc1) * m' / (sqrt(v')/sqrt(bc2) + eps)
    let p1 = e.mul(p, decay)?;
    let m1p = e.cast(m1, pd)?;
    let v1p = e.cast(v1, pd)?;
    let root = e.unary(UnaryOp::Sqrt, v1p)?;
    let corrected = e.div(root, sqrt_bc2)?;
    let denom = e.add_scalar(corrected, eps)?;
    let num = e.mul(step_size, m1p)?;
    let update = e.div(num, denom)?;
    let p_new = e.sub(p1, update)?;
    Ok(vec![p_new, m1, v1])
}

fn sgd(e: &mut Emit, p: ValueId, g: ValueId, lr: ValueId, wd: f64) -> R {
    let shape = e.shape(p);
    let pd = e.dtype(p);
    let gp = e.cast(g, pd)?;
    let decay = e.mul_scalar(p, wd)?;
    let total = e.add(gp, decay)?;
    let lr = e.cast(lr, pd)?;
    let lr = e.broadcast(lr, &shape)?;
    let step = e.mul(lr, total)?;
    e.sub(p, step)
}
