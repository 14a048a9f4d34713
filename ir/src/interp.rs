//! The reference interpreter: runs a graph on host tensors, one node at a time, in schedule order.
//!
//! It is the oracle every backend and pass is checked against, so it favours plainly correct code
//! over cleverness, with one exception: `matmul` is blocked and multi-threaded so that a small Llama
//! trains in seconds.
//!
//! Guarantees:
//! - Every element is computed in f64 and every node output is then rounded to its graph dtype
//!   (f32 and bf16 round to nearest even, integers truncate toward zero, bool is `x != 0`), so an
//!   f64 graph runs in f64 and an f32 graph in f32-rounded storage.
//! - Results do not depend on the number of threads: every sum is taken in a fixed order.
//! - Bad data (out-of-range ids, indices and targets, wrongly typed inputs) gives an
//!   [`InterpError`] naming the node, never a panic; so does a node whose declared output types
//!   disagree with the shape rules.
//! - Values are dropped after their last use unless they are graph outputs; the peak of live
//!   logical bytes (numel × dtype size, graph inputs included) is reported.

use crate::dtype::{DType, TensorType};
use crate::graph::Graph;
use crate::infer::{attention_stats_type, infer_types};
use crate::mesh::{Mesh, Reduce};
use crate::op::{BinaryOp, Collective, Op, RopeLayout};
use crate::rng;
use std::borrow::Cow;
use std::fmt;
use std::sync::OnceLock;

use crate::host_tensor::round_slice;
pub use crate::host_tensor::{round_bf16, round_to_dtype, HostTensor};

/// What `run` returns: the graph outputs in `g.outputs` order and the peak of live bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutput {
    pub outputs: Vec<HostTensor>,
    pub peak_bytes: usize,
}

/// Why a run failed, and at which node (`None` for problems with the graph inputs or outputs).
#[derive(Clone, Debug, PartialEq)]
pub struct InterpError {
    pub node: Option<usize>,
    pub module: String,
    pub op: String,
    pub message: String,
}

impl InterpError {
    pub(crate) fn plain(message: String) -> Self {
        InterpError {
            node: None,
            module: String::new(),
            op: String::new(),
            message,
        }
    }
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(n) => {
                let module = if self.module.is_empty() {
                    "<root>"
                } else {
                    &self.module
                };
                write!(f, "node {n} (`{module}`, {}): {}", self.op, self.message)
            }
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for InterpError {}

/// Runs `g` on `inputs` (given in `g.inputs` order, each of exactly the declared type).
pub fn run(g: &Graph, inputs: &[HostTensor]) -> Result<RunOutput, InterpError> {
    if let Some(mesh) = g.mesh.as_ref().filter(|m| m.world_size() != 1) {
        return Err(InterpError::plain(format!(
            "graph `{}` runs on a mesh of {} ranks ({mesh}): run it with `run_ranks`",
            g.name,
            mesh.world_size()
        )));
    }
    let mut outs = run_ranks(g, &[inputs])?;
    Ok(outs.remove(0))
}

/// Runs an SPMD graph on every rank of its mesh in this process, rank `r` on `inputs[r]`: nodes
/// run in schedule order on all ranks before the next, and a collective combines the ranks'
/// operands in rank order, so results repeat bit for bit. A graph without a mesh runs as one
/// rank. Returns each rank's outputs and peak.
pub fn run_ranks(g: &Graph, inputs: &[&[HostTensor]]) -> Result<Vec<RunOutput>, InterpError> {
    let world = g.mesh.as_ref().map_or(1, |m| m.world_size());
    if inputs.len() != world {
        return Err(InterpError::plain(format!(
            "graph `{}` has {world} rank(s) but inputs for {} were given",
            g.name,
            inputs.len()
        )));
    }
    for rank_inputs in inputs {
        check_inputs(g, rank_inputs)?;
    }
    let num_values = g.values.len();
    let out_of_graph = |v: usize| {
        InterpError::plain(format!(
            "value %{v} is not in graph `{}` ({num_values} values)",
            g.name
        ))
    };

    // The node after which each value is no longer needed; graph outputs are never freed.
    let mut last_use: Vec<Option<usize>> = vec![None; num_values];
    for (i, n) in g.nodes.iter().enumerate() {
        for v in n.inputs.iter().chain(&n.outputs) {
            if v.index() >= num_values {
                return Err(out_of_graph(v.index()));
            }
        }
        for v in &n.inputs {
            last_use[v.index()] = Some(i);
        }
    }
    let mut keep = vec![false; num_values];
    for o in &g.outputs {
        *keep
            .get_mut(o.value.index())
            .ok_or_else(|| out_of_graph(o.value.index()))? = true;
    }

    let mut ranks: Vec<RankState<'_>> = inputs
        .iter()
        .map(|rank_inputs| {
            let mut st = RankState {
                slots: vec![None; num_values],
                live: 0,
                peak: 0,
            };
            for (decl, t) in g.inputs.iter().zip(*rank_inputs) {
                let slot = &mut st.slots[decl.value.index()];
                if slot.is_none() {
                    st.live += t.size_bytes();
                    *slot = Some(Cow::Borrowed(t));
                }
            }
            st.peak = st.live;
            for decl in &g.inputs {
                let v = decl.value.index();
                if last_use[v].is_none() && !keep[v] {
                    free(&mut st.slots[v], &mut st.live);
                }
            }
            st
        })
        .collect();

    for (i, node) in g.nodes.iter().enumerate() {
        let at_node = |message: String| InterpError {
            node: Some(i),
            module: node.meta.module.clone(),
            op: node.op.name().to_string(),
            message,
        };
        let declared: Vec<TensorType> = node
            .outputs
            .iter()
            .map(|o| g.values[o.index()].clone())
            .collect();
        let mut results: Vec<Vec<Vec<f64>>> = Vec::with_capacity(world);
        {
            let mut operands: Vec<Vec<&HostTensor>> = Vec::with_capacity(world);
            for st in &ranks {
                let mut ops: Vec<&HostTensor> = Vec::with_capacity(node.inputs.len());
                for v in &node.inputs {
                    let t = st.slots[v.index()].as_deref().ok_or_else(|| {
                        at_node(format!(
                            "reads %{} before any node defines it (or after it was freed)",
                            v.index()
                        ))
                    })?;
                    ops.push(t);
                }
                let operand_types: Vec<TensorType> = ops.iter().map(|t| t.ty.clone()).collect();
                let inferred = infer_types(&node.op, &operand_types).map_err(&at_node)?;
                if inferred != declared {
                    return Err(at_node(format!(
                        "the graph declares outputs {} but the op produces {}",
                        type_list(&declared),
                        type_list(&inferred)
                    )));
                }
                operands.push(ops);
            }
            if let Op::CollectiveStart {
                collective,
                mesh_dims,
                ..
            } = &node.op
            {
                let mesh = g
                    .mesh
                    .as_ref()
                    .ok_or_else(|| at_node("a collective in a graph without a mesh".into()))?;
                let xs: Vec<&HostTensor> = operands.iter().map(|o| o[0]).collect();
                for r in 0..world {
                    let out = collective_eval(*collective, mesh, mesh_dims, r, &xs, &declared[0])
                        .map_err(&at_node)?;
                    results.push(vec![out]);
                }
            } else {
                for ops in &operands {
                    results.push(eval(&node.op, ops, &declared).map_err(&at_node)?);
                }
            }
        }
        for (st, rank_results) in ranks.iter_mut().zip(results) {
            for ((o, ty), mut data) in node.outputs.iter().zip(&declared).zip(rank_results) {
                if data.len() != ty.numel() {
                    // Every kernel sizes its result from the inferred type; this guards that promise.
                    return Err(at_node(format!(
                        "internal error: produced {} values for a {ty} output",
                        data.len()
                    )));
                }
                round_slice(ty.dtype, &mut data);
                st.live += ty.size_bytes();
                st.slots[o.index()] = Some(Cow::Owned(HostTensor {
                    ty: ty.clone(),
                    data,
                }));
            }
            st.peak = st.peak.max(st.live);
            for v in node.inputs.iter().chain(&node.outputs) {
                let v = v.index();
                let dead = match last_use[v] {
                    Some(last) => last <= i,
                    None => true,
                };
                if dead && !keep[v] {
                    free(&mut st.slots[v], &mut st.live);
                }
            }
        }
    }

    ranks
        .into_iter()
        .map(|mut st| {
            // Outputs move out of their slots; only a value listed more than once is cloned.
            let mut pending = vec![0usize; num_values];
            for o in &g.outputs {
                pending[o.value.index()] += 1;
            }
            let mut outputs = Vec::with_capacity(g.outputs.len());
            for o in &g.outputs {
                let v = o.value.index();
                let missing = || {
                    InterpError::plain(format!(
                        "output `{}` reads %{v}, which nothing defines",
                        o.name
                    ))
                };
                pending[v] -= 1;
                let t = if pending[v] == 0 {
                    st.slots[v].take().ok_or_else(missing)?.into_owned()
                } else {
                    st.slots[v].as_deref().ok_or_else(missing)?.clone()
                };
                outputs.push(t);
            }
            Ok(RunOutput {
                outputs,
                peak_bytes: st.peak,
            })
        })
        .collect()
}

/// One rank's live values.
struct RankState<'a> {
    slots: Vec<Option<Cow<'a, HostTensor>>>,
    live: usize,
    peak: usize,
}

fn check_inputs(g: &Graph, inputs: &[HostTensor]) -> Result<(), InterpError> {
    if inputs.len() != g.inputs.len() {
        let names: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(InterpError::plain(format!(
            "graph `{}` takes {} input(s) ({}), got {}",
            g.name,
            g.inputs.len(),
            names.join(", "),
            inputs.len()
        )));
    }
    for (decl, t) in g.inputs.iter().zip(inputs) {
        let want = g.values.get(decl.value.index()).ok_or_else(|| {
            InterpError::plain(format!(
                "value %{} is not in graph `{}` ({} values)",
                decl.value.index(),
                g.name,
                g.values.len()
            ))
        })?;
        if t.ty != *want {
            return Err(InterpError::plain(format!(
                "input `{}` must be {want}, got {}",
                decl.name, t.ty
            )));
        }
        if t.data.len() != want.numel() {
            return Err(InterpError::plain(format!(
                "input `{}` is {want} ({} elements) but holds {} values",
                decl.name,
                want.numel(),
                t.data.len()
            )));
        }
    }
    Ok(())
}

/// What `collective` gives rank `rank`, from every rank's operand `xs` (in rank order). Sums run
/// over the group in group order, whatever the rank, so every member gets the same bits.
fn collective_eval(
    collective: Collective,
    mesh: &Mesh,
    mesh_dims: &[usize],
    rank: usize,
    xs: &[&HostTensor],
    out: &TensorType,
) -> Result<Vec<f64>, String> {
    let group = mesh.group(rank, mesh_dims);
    let me = mesh.group_index(rank, mesh_dims);
    let n = group.len();
    let members: Vec<&HostTensor> = group.iter().map(|&r| xs[r]).collect();
    let x_shape = &members[0].ty.shape;
    let reduce = |r: Reduce| -> Vec<f64> {
        let mut acc = members[0].data.clone();
        for m in &members[1..] {
            for (a, b) in acc.iter_mut().zip(&m.data) {
                *a += b;
            }
        }
        if r == Reduce::Avg {
            for a in &mut acc {
                *a /= n as f64;
            }
        }
        acc
    };
    // Block `k` of `data` (of `shape`) along `axis`, of `n` equal blocks.
    let block = |data: &[f64], shape: &[usize], axis: usize, k: usize| -> Vec<f64> {
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let len = shape[axis] / n;
        let mut v = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let base = o * shape[axis] * inner + k * len * inner;
            v.extend_from_slice(&data[base..base + len * inner]);
        }
        v
    };
    // `parts` (each of `shape`) concatenated along `axis`.
    let concat = |parts: &[Vec<f64>], shape: &[usize], axis: usize| -> Vec<f64> {
        let outer: usize = shape[..axis].iter().product();
        let chunk: usize = shape[axis..].iter().product();
        let mut v = Vec::with_capacity(outer * chunk * parts.len());
        for o in 0..outer {
            for p in parts {
                v.extend_from_slice(&p[o * chunk..(o + 1) * chunk]);
            }
        }
        v
    };
    let v = match collective {
        Collective::AllGather { axis } => {
            let parts: Vec<Vec<f64>> = members.iter().map(|m| m.data.clone()).collect();
            concat(&parts, x_shape, axis)
        }
        Collective::ReduceScatter { axis, reduce: r } => block(&reduce(r), x_shape, axis, me),
        Collective::AllReduce { reduce: r } => reduce(r),
        Collective::AllToAll {
            split_axis,
            concat_axis,
        } => {
            let parts: Vec<Vec<f64>> = members
                .iter()
                .map(|m| block(&m.data, x_shape, split_axis, me))
                .collect();
            let mut part_shape = x_shape.clone();
            part_shape[split_axis] /= n;
            concat(&parts, &part_shape, concat_axis)
        }
        Collective::Broadcast { root } => members[root].data.clone(),
    };
    if v.len() != out.numel() {
        return Err(format!(
            "internal error: the collective produced {} values for {out}",
            v.len()
        ));
    }
    Ok(v)
}

fn free(slot: &mut Option<Cow<'_, HostTensor>>, live: &mut usize) {
    if let Some(t) = slot.take() {
        *live -= t.size_bytes();
    }
}

fn type_list(types: &[TensorType]) -> String {
    let parts: Vec<String> = types.iter().map(|t| t.to_string()).collect();
    format!("({})", parts.join(", "))
}

/// Computes the (unrounded) outputs of `op`. `outs` are the output types, already checked against
/// the shape rules, so kernels may rely on every shape relation `infer_types` enforces.
fn eval(op: &Op, ins: &[&HostTensor], outs: &[TensorType]) -> Result<Vec<Vec<f64>>, String> {
    let out = &outs[0];
    let one = |data: Vec<f64>| Ok(vec![data]);
    let Some(&x) = ins.first() else {
        return match op {
            Op::Full { value, .. } => one(vec![*value; out.numel()]),
            Op::Iota { shape, axis, .. } => {
                let inner: usize = shape[axis + 1..].iter().product();
                let dim = shape[*axis];
                one((0..out.numel())
                    .map(|i| ((i / inner) % dim) as f64)
                    .collect())
            }
            other => Err(format!(
                "internal error: {} reached the interpreter without operands",
                other.name()
            )),
        };
    };
    match op {
        Op::Unary(u) => one(x.data.iter().map(|&a| u.apply(a)).collect()),
        Op::Binary(b) => one(zip_map(&x.data, &ins[1].data, |p, q| b.apply(p, q))),
        Op::Compare(c) => one(zip_map(&x.data, &ins[1].data, |p, q| {
            if c.apply(p, q) {
                1.0
            } else {
                0.0
            }
        })),
        Op::Select => one(x
            .data
            .iter()
            .zip(&ins[1].data)
            .zip(&ins[2].data)
            .map(|((&c, &a), &b)| if c != 0.0 { a } else { b })
            .collect()),
        Op::AddScalar { value } => one(x.data.iter().map(|&a| a + value).collect()),
        Op::MulScalar { value } => one(x.data.iter().map(|&a| a * value).collect()),
        Op::PowScalar { exponent } => one(x.data.iter().map(|&a| a.powf(*exponent)).collect()),
        // The conversion itself is the rounding every output gets.
        Op::Cast { .. } => one(x.data.clone()),
        Op::ReduceSum { axes, .. } => one(reduce(x, axes, 0.0, |acc, v| acc + v)),
        Op::ReduceMax { axes, .. } => one(reduce(x, axes, f64::NEG_INFINITY, |acc, v| {
            BinaryOp::Max.apply(acc, v)
        })),
        Op::Reshape { .. } | Op::Offload | Op::Reload => one(x.data.clone()),
        Op::Transpose { perm } => {
            let s = strides(x.shape());
            let ps: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
            one(strided_copy(&x.data, &out.shape, &ps, 0))
        }
        Op::Expand { .. } => {
            let s: Vec<usize> = strides(x.shape())
                .into_iter()
                .zip(x.shape())
                .map(|(st, &d)| if d == 1 { 0 } else { st })
                .collect();
            one(strided_copy(&x.data, &out.shape, &s, 0))
        }
        Op::Slice { axis, start, .. } => {
            let s = strides(x.shape());
            one(strided_copy(&x.data, &out.shape, &s, start * s[*axis]))
        }
        Op::Concat { axis } => one(concat(ins, *axis, out)),
        Op::Gather { axis } => one(gather(x, ins[1], *axis)?),
        Op::ScatterAdd { axis } => one(scatter_add(x, ins[1], ins[2], *axis)?),
        Op::Matmul => one(matmul(x, ins[1], num_threads())),
        Op::Full { .. } | Op::Iota { .. } => {
            Err(format!("internal error: {} got operands", op.name()))
        }
        Op::RandomUniform { stream, .. } | Op::RandomNormal { stream, .. } => {
            // Seeds are integer tensors, so the f64 holds a whole number; negative seeds wrap
            // through i64 as they would on a backend holding them as int64.
            let seed = x.data.first().copied().unwrap_or(0.0) as i64 as u64;
            let draw = if matches!(op, Op::RandomUniform { .. }) {
                rng::uniform
            } else {
                rng::normal
            };
            one((0..out.numel())
                .map(|i| draw(seed, *stream, i as u64))
                .collect())
        }
        Op::Embedding => one(embedding(x, ins[1])?),
        Op::EmbeddingBackward { rows } => one(embedding_backward(x, ins[1], *rows)?),
        Op::RmsNorm { eps } => one(rms_norm(x, ins[1], *eps)),
        Op::RmsNormBackward { eps } => {
            let (gx, gw) = rms_norm_backward(x, ins[1], ins[2], *eps);
            Ok(vec![gx, gw])
        }
        Op::Rope {
            theta,
            layout,
            inverse,
        } => one(rope(x, *theta, *layout, *inverse)),
        Op::Attention {
            causal,
            scale,
            stats,
        } => {
            let (out, row_stats) = attention(x, ins[1], ins[2], *causal, *scale);
            Ok(if *stats {
                vec![out, row_stats]
            } else {
                vec![out]
            })
        }
        Op::AttentionBackward {
            causal,
            scale,
            stats,
        } => {
            let stats = stats.then(|| &ins[4].data[..]);
            let (dq, dk, dv) =
                attention_backward(x, ins[1], ins[2], ins[3], stats, *causal, *scale);
            Ok(vec![dq, dk, dv])
        }
        Op::Softmax { axis } => one(softmax(x, *axis, false)),
        Op::LogSoftmax { axis } => one(softmax(x, *axis, true)),
        Op::CrossEntropy => one(vec![cross_entropy(x, ins[1])?]),
        Op::CrossEntropyBackward => {
            let g = ins[2].data.first().copied().unwrap_or(f64::NAN);
            one(cross_entropy_backward(x, ins[1], g)?)
        }
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let (p, m, v) = adamw(ins, *beta1, *beta2, *eps, *weight_decay);
            Ok(vec![p, m, v])
        }
        Op::Sgd { weight_decay } => {
            let lr = ins[2].data.first().copied().unwrap_or(f64::NAN);
            one(zip_map(&x.data, &ins[1].data, |p, g| {
                p - lr * (g + weight_decay * p)
            }))
        }
        // The handle holds the collective's result; `run_ranks` computes it across ranks.
        Op::Wait => one(x.data.clone()),
        Op::ToPartial { group, .. } => one(x.data.iter().map(|&a| a / *group as f64).collect()),
        Op::CollectiveStart { .. } => {
            Err("internal error: collectives are evaluated across ranks".into())
        }
    }
}

fn zip_map(a: &[f64], b: &[f64], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    a.iter().zip(b).map(|(&p, &q)| f(p, q)).collect()
}

/// Row-major strides of `shape`, in elements.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The multi-index of row-major position `lin` in `shape`, for error messages.
fn unravel(mut lin: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            idx[d] = lin % shape[d];
            lin /= shape[d];
        }
    }
    idx
}

/// Offsets `base + Σ idx[d] * strides[d]` for every multi-index of `shape` in row-major order. With
/// zero strides this walks a broadcast, with permuted strides a transpose.
struct Offsets<'a> {
    shape: &'a [usize],
    strides: &'a [usize],
    idx: Vec<usize>,
    offset: usize,
    remaining: usize,
}

impl<'a> Offsets<'a> {
    fn new(shape: &'a [usize], strides: &'a [usize], base: usize) -> Self {
        Offsets {
            shape,
            strides,
            idx: vec![0; shape.len()],
            offset: base,
            remaining: shape.iter().product(),
        }
    }
}

impl Iterator for Offsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        let current = self.offset;
        self.remaining -= 1;
        if self.remaining > 0 {
            for d in (0..self.shape.len()).rev() {
                self.idx[d] += 1;
                self.offset += self.strides[d];
                if self.idx[d] < self.shape[d] {
                    break;
                }
                self.offset -= self.strides[d] * self.shape[d];
                self.idx[d] = 0;
            }
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

fn strided_copy(src: &[f64], shape: &[usize], strides: &[usize], base: usize) -> Vec<f64> {
    Offsets::new(shape, strides, base).map(|o| src[o]).collect()
}

/// Folds `x` over `axes`; the result is laid out like the keepdim shape, which has the same
/// row-major order as the squeezed one.
fn reduce(x: &HostTensor, axes: &[usize], init: f64, f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    let kept: Vec<usize> = x
        .shape()
        .iter()
        .enumerate()
        .map(|(d, &n)| if axes.contains(&d) { 1 } else { n })
        .collect();
    let out_strides: Vec<usize> = strides(&kept)
        .into_iter()
        .enumerate()
        .map(|(d, s)| if axes.contains(&d) { 0 } else { s })
        .collect();
    let mut acc = vec![init; kept.iter().product()];
    for (o, &v) in Offsets::new(x.shape(), &out_strides, 0).zip(&x.data) {
        acc[o] = f(acc[o], v);
    }
    acc
}

fn concat(ins: &[&HostTensor], axis: usize, out: &TensorType) -> Vec<f64> {
    let outer: usize = out.shape[..axis].iter().product();
    let inner: usize = out.shape[axis + 1..].iter().product();
    let mut data = Vec::with_capacity(out.numel());
    for o in 0..outer {
        for t in ins {
            let len = t.shape()[axis] * inner;
            data.extend_from_slice(&t.data[o * len..(o + 1) * len]);
        }
    }
    data
}

/// `v` as an index into a dim of size `bound`, or why not.
fn check_index(
    v: f64,
    bound: usize,
    what: &str,
    pos: usize,
    shape: &[usize],
) -> Result<usize, String> {
    if v >= 0.0 && v < bound as f64 && v.fract() == 0.0 {
        Ok(v as usize)
    } else {
        Err(format!(
            "{what} {v} at position {:?} is out of range 0..{bound}",
            unravel(pos, shape)
        ))
    }
}

fn gather(x: &HostTensor, idx: &HostTensor, axis: usize) -> Result<Vec<f64>, String> {
    let xs = strides(x.shape());
    let mut walk = xs.clone();
    walk[axis] = 0;
    let bound = x.shape()[axis];
    let mut out = Vec::with_capacity(idx.data.len());
    for (pos, (base, &i)) in Offsets::new(idx.shape(), &walk, 0)
        .zip(&idx.data)
        .enumerate()
    {
        let i = check_index(i, bound, "index", pos, idx.shape())?;
        out.push(x.data[base + i * xs[axis]]);
    }
    Ok(out)
}

fn scatter_add(
    x: &HostTensor,
    idx: &HostTensor,
    src: &HostTensor,
    axis: usize,
) -> Result<Vec<f64>, String> {
    let xs = strides(x.shape());
    let mut walk = xs.clone();
    walk[axis] = 0;
    let bound = x.shape()[axis];
    let mut out = x.data.clone();
    let walk = Offsets::new(idx.shape(), &walk, 0);
    for (pos, ((base, &i), &s)) in walk.zip(&idx.data).zip(&src.data).enumerate() {
        let i = check_index(i, bound, "index", pos, idx.shape())?;
        out[base + i * xs[axis]] += s;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Threads

/// Below this many flops a kernel runs on the calling thread: spawning costs tens of microseconds.
const PARALLEL_MIN_WORK: usize = 1 << 20;

fn num_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Calls `f` on every item, handing contiguous runs of items to up to `threads` scoped threads when
/// `work` (a rough flop count) is worth it. Items own disjoint output slices, so the result does not
/// depend on how they are split.
fn par_for_each<T: Send>(items: Vec<T>, threads: usize, work: usize, f: impl Fn(T) + Sync) {
    let threads = threads.min(items.len());
    if threads <= 1 || work < PARALLEL_MIN_WORK {
        items.into_iter().for_each(f);
        return;
    }
    let per = items.len().div_ceil(threads);
    let mut groups: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut items = items.into_iter();
    loop {
        let group: Vec<T> = items.by_ref().take(per).collect();
        if group.is_empty() {
            break;
        }
        groups.push(group);
    }
    let f = &f;
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || group.into_iter().for_each(f));
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Matmul

/// Rows of A per micro tile.
const MR: usize = 4;
/// Columns of B per packed panel and micro tile.
const NR: usize = 8;
/// Depth of a k block: a packed B panel slice (KC × NR) stays in L1.
const KC: usize = 256;
/// Rows of A per packed block: MC × KC stays in L2.
const MC: usize = 64;

/// `[..., M, K] @ [..., K, N]` (or a rank-2 B shared by every batch). Each output element is
/// `((0 + a0·b0) + a1·b1) + ...` in increasing k whatever the blocking and thread count.
fn matmul(a: &HostTensor, b: &HostTensor, threads: usize) -> Vec<f64> {
    let (ra, rb) = (a.ty.rank(), b.ty.rank());
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let n = b.shape()[rb - 1];
    let batch: usize = a.shape()[..ra - 2].iter().product();
    let shared = rb == 2;
    matmul_raw(&a.data, &b.data, batch, m, k, n, shared, threads)
}

#[allow(clippy::too_many_arguments)]
fn matmul_raw(
    a: &[f64],
    b: &[f64],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    shared: bool,
    threads: usize,
) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    if c.is_empty() || k == 0 {
        return c;
    }
    let b_batches = if shared { 1 } else { batch };
    let panels = n.div_ceil(NR);
    let packed_len = panels * k * NR;
    // B is packed into NR-wide column panels, [panel][k][NR], zero-padded past column n; the
    // padding only feeds columns that are never stored.
    let mut packed = vec![0.0; b_batches * packed_len];
    for bi in 0..b_batches {
        let src = &b[bi * k * n..(bi + 1) * k * n];
        let dst = &mut packed[bi * packed_len..(bi + 1) * packed_len];
        for (kk, row) in src.chunks_exact(n).enumerate() {
            for (p, cols) in row.chunks(NR).enumerate() {
                let at = p * k * NR + kk * NR;
                dst[at..at + cols.len()].copy_from_slice(cols);
            }
        }
    }

    let rows = batch * m;
    let tasks = threads.max(1).min(rows);
    let rows_per_task = rows.div_ceil(tasks);
    let items: Vec<(usize, &mut [f64])> = c
        .chunks_mut(rows_per_task * n)
        .enumerate()
        .map(|(t, chunk)| (t * rows_per_task, chunk))
        .collect();
    let packed = &packed;
    par_for_each(items, threads, 2 * rows * k * n, |(first_row, chunk)| {
        let end_row = first_row + chunk.len() / n;
        let mut r = first_row;
        // A task's rows may straddle batches; each batch has its own packed B.
        while r < end_row {
            let bi = r / m;
            let seg_end = end_row.min((bi + 1) * m);
            let bp = if shared {
                &packed[..packed_len]
            } else {
                &packed[bi * packed_len..(bi + 1) * packed_len]
            };
            let c_seg = &mut chunk[(r - first_row) * n..(seg_end - first_row) * n];
            gemm_block(&a[r * k..seg_end * k], bp, c_seg, k, n);
            r = seg_end;
        }
    });
    c
}

/// `c += a @ B` for `a` (rows × k, row-major) and `bp`, B packed as above, blocked so that the
/// packed A block stays in L2 and each panel slice in L1.
fn gemm_block(a: &[f64], bp: &[f64], c: &mut [f64], k: usize, n: usize) {
    let rows = a.len() / k;
    let panels = n.div_ceil(NR);
    let avx = has_avx();
    let mut apack = vec![0.0; MC * KC];
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        for i0 in (0..rows).step_by(MC) {
            let mc = MC.min(rows - i0);
            let full = mc / MR;
            // Full MR-row tiles are interleaved as [tile][k][MR] so the kernel reads A
            // sequentially; leftover rows are used in place, one at a time.
            for t in 0..full {
                let tile = &mut apack[t * kc * MR..(t + 1) * kc * MR];
                for r in 0..MR {
                    let row = &a[(i0 + t * MR + r) * k + k0..][..kc];
                    for (kk, &v) in row.iter().enumerate() {
                        tile[kk * MR + r] = v;
                    }
                }
            }
            for p in 0..panels {
                let col0 = p * NR;
                let ncols = NR.min(n - col0);
                let panel = &bp[p * k * NR + k0 * NR..][..kc * NR];
                for t in 0..full {
                    let a_tile = &apack[t * kc * MR..(t + 1) * kc * MR];
                    let row0 = i0 + t * MR;
                    let mut acc: [[f64; NR]; MR] = load_tile(c, row0, col0, ncols, n);
                    accumulate_full_tile(a_tile, panel, &mut acc, avx);
                    store_tile(&acc, c, row0, col0, ncols, n);
                }
                for r in i0 + full * MR..i0 + mc {
                    let row = &a[r * k + k0..][..kc];
                    let mut acc: [[f64; NR]; 1] = load_tile(c, r, col0, ncols, n);
                    accumulate(row, panel, &mut acc);
                    store_tile(&acc, c, r, col0, ncols, n);
                }
            }
        }
    }
}

/// The running sums of an R × NR tile of `c` (columns past `ncols` are zero and never stored).
/// Sums restart from what earlier k blocks left in `c`, which keeps the sequential k order.
fn load_tile<const R: usize>(
    c: &[f64],
    row0: usize,
    col0: usize,
    ncols: usize,
    n: usize,
) -> [[f64; NR]; R] {
    let mut acc = [[0.0; NR]; R];
    for (r, acc_row) in acc.iter_mut().enumerate() {
        acc_row[..ncols].copy_from_slice(&c[(row0 + r) * n + col0..][..ncols]);
    }
    acc
}

fn store_tile<const R: usize>(
    acc: &[[f64; NR]; R],
    c: &mut [f64],
    row0: usize,
    col0: usize,
    ncols: usize,
    n: usize,
) {
    for (r, acc_row) in acc.iter().enumerate() {
        c[(row0 + r) * n + col0..][..ncols].copy_from_slice(&acc_row[..ncols]);
    }
}

/// `acc += a_tile @ panel` over one k block: `a` is [k][R], `panel` is [k][NR].
fn accumulate<const R: usize>(a: &[f64], panel: &[f64], acc: &mut [[f64; NR]; R]) {
    for (ak, bk) in a.chunks_exact(R).zip(panel.chunks_exact(NR)) {
        for (acc_row, &av) in acc.iter_mut().zip(ak) {
            for (x, &bv) in acc_row.iter_mut().zip(bk) {
                *x += av * bv;
            }
        }
    }
}

fn has_avx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`accumulate`] for a full MR-row tile, through AVX when `avx` says the CPU has it. LLVM
/// vectorizes the portable loop across the 4 rows of A and reshuffles the accumulators every step
/// (about 3 GFLOP/s); the explicit kernel keeps the 4 × 8 tile in eight registers (about 15).
/// Multiplies and adds stay separate (no FMA), so both paths round identically.
fn accumulate_full_tile(a: &[f64], panel: &[f64], acc: &mut [[f64; NR]; MR], avx: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx {
            // SAFETY: `avx` comes from `has_avx`, so the CPU supports the instructions.
            unsafe { accumulate_avx(a, panel, acc) };
            return;
        }
    }
    let _ = avx;
    accumulate(a, panel, acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn accumulate_avx(a: &[f64], panel: &[f64], acc: &mut [[f64; NR]; MR]) {
    use std::arch::x86_64::{
        _mm256_add_pd, _mm256_loadu_pd, _mm256_mul_pd, _mm256_set1_pd, _mm256_storeu_pd,
    };
    // SAFETY (every load and store): each pointer comes from a slice or array holding at least
    // the 4 f64 it touches (`bk` has NR = 8 elements, each `acc` row has NR), and the unaligned
    // forms have no alignment requirement.
    let mut regs = [[_mm256_set1_pd(0.0); 2]; MR];
    for (reg, row) in regs.iter_mut().zip(acc.iter()) {
        reg[0] = _mm256_loadu_pd(row.as_ptr());
        reg[1] = _mm256_loadu_pd(row[4..].as_ptr());
    }
    for (ak, bk) in a.chunks_exact(MR).zip(panel.chunks_exact(NR)) {
        let b0 = _mm256_loadu_pd(bk.as_ptr());
        let b1 = _mm256_loadu_pd(bk[4..].as_ptr());
        for (reg, &av) in regs.iter_mut().zip(ak) {
            let av = _mm256_set1_pd(av);
            reg[0] = _mm256_add_pd(reg[0], _mm256_mul_pd(av, b0));
            reg[1] = _mm256_add_pd(reg[1], _mm256_mul_pd(av, b1));
        }
    }
    for (reg, row) in regs.iter().zip(acc.iter_mut()) {
        _mm256_storeu_pd(row.as_mut_ptr(), reg[0]);
        _mm256_storeu_pd(row[4..].as_mut_ptr(), reg[1]);
    }
}

// ---------------------------------------------------------------------------------------------
// Composites

fn embedding(w: &HostTensor, ids: &HostTensor) -> Result<Vec<f64>, String> {
    let (rows, d) = (w.shape()[0], w.shape()[1]);
    let mut out = Vec::with_capacity(ids.data.len() * d);
    for (pos, &id) in ids.data.iter().enumerate() {
        let id = check_index(id, rows, "id", pos, ids.shape())?;
        out.extend_from_slice(&w.data[id * d..(id + 1) * d]);
    }
    Ok(out)
}

fn embedding_backward(g: &HostTensor, ids: &HostTensor, rows: usize) -> Result<Vec<f64>, String> {
    let d = g.shape()[g.ty.rank() - 1];
    let mut out = vec![0.0; rows * d];
    for (pos, &id) in ids.data.iter().enumerate() {
        let id = check_index(id, rows, "id", pos, ids.shape())?;
        for (o, &v) in out[id * d..(id + 1) * d]
            .iter_mut()
            .zip(&g.data[pos * d..(pos + 1) * d])
        {
            *o += v;
        }
    }
    Ok(out)
}

/// `1 / sqrt(mean(row²) + eps)` for every row of the last axis.
fn rms_factors(x: &[f64], d: usize, eps: f64) -> Vec<f64> {
    x.chunks_exact(d)
        .map(|row| {
            let ss: f64 = row.iter().map(|v| v * v).sum();
            1.0 / (ss / d as f64 + eps).sqrt()
        })
        .collect()
}

fn last_dim(t: &HostTensor) -> usize {
    t.shape()[t.ty.rank() - 1]
}

fn rms_norm(x: &HostTensor, w: &HostTensor, eps: f64) -> Vec<f64> {
    let d = last_dim(x);
    if d == 0 {
        return Vec::new();
    }
    let r = rms_factors(&x.data, d, eps);
    let mut out = Vec::with_capacity(x.data.len());
    for (row, r) in x.data.chunks_exact(d).zip(r) {
        out.extend(row.iter().zip(&w.data).map(|(v, wv)| v * r * wv));
    }
    out
}

fn rms_norm_backward(
    x: &HostTensor,
    w: &HostTensor,
    gy: &HostTensor,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let d = last_dim(x);
    let mut gx = Vec::with_capacity(x.data.len());
    let mut gw = vec![0.0; d];
    if d == 0 {
        return (gx, gw);
    }
    let r = rms_factors(&x.data, d, eps);
    for ((row, grow), r) in x.data.chunks_exact(d).zip(gy.data.chunks_exact(d)).zip(r) {
        let mut dot = 0.0;
        for j in 0..d {
            let xhat = row[j] * r;
            gw[j] += grow[j] * xhat;
            dot += grow[j] * w.data[j] * xhat;
        }
        let mean = dot / d as f64;
        gx.extend((0..d).map(|j| r * (grow[j] * w.data[j] - row[j] * r * mean)));
    }
    (gx, gw)
}

fn rope(x: &HostTensor, theta: f64, layout: RopeLayout, inverse: bool) -> Vec<f64> {
    let (s, h, d) = (x.shape()[1], x.shape()[2], x.shape()[3]);
    let mut out = x.data.clone();
    if d == 0 {
        return out;
    }
    let half = d / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    // (cos, sin) per position and pair, shared by every batch row and head.
    let mut table = Vec::with_capacity(s * half);
    for pos in 0..s {
        for i in 0..half {
            let freq = theta.powf(-((2 * i) as f64) / d as f64);
            let angle = sign * (pos as f64 * freq);
            table.push((angle.cos(), angle.sin()));
        }
    }
    for (vec_idx, head) in out.chunks_exact_mut(d).enumerate() {
        let pos = (vec_idx / h) % s;
        for (i, &(cos, sin)) in table[pos * half..(pos + 1) * half].iter().enumerate() {
            let (ia, ib) = match layout {
                RopeLayout::Half => (i, i + half),
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
            };
            let (a, bv) = (head[ia], head[ib]);
            head[ia] = a * cos - bv * sin;
            head[ib] = a * sin + bv * cos;
        }
    }
    out
}

/// Shapes of an attention call: q `[B, Hq, S, D]`, kv heads, group size, and the dtype its
/// softmax statistics are held in.
struct AttnDims {
    hq: usize,
    hkv: usize,
    s: usize,
    d: usize,
    stats: DType,
}

impl AttnDims {
    fn of(q: &HostTensor, k: &HostTensor) -> Self {
        AttnDims {
            hq: q.shape()[1],
            hkv: k.shape()[1],
            s: q.shape()[2],
            d: q.shape()[3],
            stats: attention_stats_type(&q.ty).dtype,
        }
    }

    fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// Softmax probabilities of query `i` against keys `0..len`, written into `p[..len]`; `len` is
    /// `i + 1` when causal, so masked keys are never touched (their probability is exactly 0).
    /// Returns the row's statistics `(max, sum)`: the max scaled score and the sum of
    /// `exp(score - max)`, by which the scores were shifted and divided. The scores and the
    /// sum are held in the statistics' dtype (f32 for f32 and bf16 attention, as the kernels
    /// hold them; the identity in f64), so that probabilities rebuilt from stored statistics
    /// (`probs_from`) are these bit for bit, and the largest score's shifted value is 0.
    fn probs(&self, qi: &[f64], kh: &[f64], len: usize, scale: f64, p: &mut [f64]) -> (f64, f64) {
        let d = self.d;
        let mut max = f64::NEG_INFINITY;
        for (j, pj) in p[..len].iter_mut().enumerate() {
            *pj = self.score(qi, &kh[j * d..(j + 1) * d], scale);
            max = BinaryOp::Max.apply(max, *pj);
        }
        let mut sum = 0.0;
        for pj in &mut p[..len] {
            *pj = (*pj - max).exp();
            sum += *pj;
        }
        let sum = round_to_dtype(self.stats, sum);
        for pj in &mut p[..len] {
            *pj /= sum;
        }
        (max, sum)
    }

    /// `probs` from given statistics (the forward's, `Op::Attention`'s `stats`): `p_j =
    /// exp(score_j - max) / sum`.
    fn probs_from(
        &self,
        qi: &[f64],
        kh: &[f64],
        len: usize,
        scale: f64,
        (max, sum): (f64, f64),
        p: &mut [f64],
    ) {
        let d = self.d;
        for (j, pj) in p[..len].iter_mut().enumerate() {
            *pj = (self.score(qi, &kh[j * d..(j + 1) * d], scale) - max).exp() / sum;
        }
    }

    /// `q_i · k_j · scale`, held in the statistics' dtype.
    fn score(&self, qi: &[f64], kj: &[f64], scale: f64) -> f64 {
        round_to_dtype(self.stats, scale * dot(qi, kj))
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// What bf16 attention's products read of an f32 quantity (probabilities, score gradients):
/// it rounded to bf16, as torch's cpu kernel and ours round them (`Step::Attention`); f32
/// attention reads it as it is.
fn as_product_operand(x: f64, bf16: bool) -> f64 {
    if bf16 {
        f64::from(round_bf16(x as f32))
    } else {
        x
    }
}

/// `softmax(q kᵀ · scale + mask) v`, and each query row's softmax statistics `(max, sum)`
/// (`[B, Hq, S, 2]`); in bf16 the probabilities are rounded to bf16 before the product with `v`
/// (`as_product_operand`).
fn attention(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let bf16 = q.ty.dtype == DType::BF16;
    let dims = AttnDims::of(q, k);
    let (s, d, group) = (dims.s, dims.d, dims.group());
    let head = s * d;
    let mut out = vec![0.0; q.data.len()];
    let mut stats = vec![0.0; q.shape()[..3].iter().product::<usize>() * 2];
    if head == 0 {
        return (out, stats);
    }
    // (head index, (its output, its rows' statistics))
    let items: Vec<_> = out
        .chunks_mut(head)
        .zip(stats.chunks_mut(2 * s))
        .enumerate()
        .collect();
    let work = 4 * q.data.len() * s;
    par_for_each(items, num_threads(), work, |(bh, (o, row_stats))| {
        let (bi, h) = (bh / dims.hq, bh % dims.hq);
        let kv = (bi * dims.hkv + h / group) * head;
        let (qh, kh, vh) = (
            &q.data[bh * head..][..head],
            &k.data[kv..][..head],
            &v.data[kv..][..head],
        );
        let mut p = vec![0.0; s];
        for i in 0..s {
            let len = if causal { i + 1 } else { s };
            let (max, sum) = dims.probs(&qh[i * d..(i + 1) * d], kh, len, scale, &mut p);
            row_stats[2 * i] = max;
            row_stats[2 * i + 1] = sum;
            let oi = &mut o[i * d..(i + 1) * d];
            for (j, &pj) in p[..len].iter().enumerate() {
                let pj = as_product_operand(pj, bf16);
                for (oc, &vc) in oi.iter_mut().zip(&vh[j * d..(j + 1) * d]) {
                    *oc += pj * vc;
                }
            }
        }
    });
    (out, stats)
}

/// The gradient slices one (batch, kv head) pair owns in `attention_backward`: its dk and dv, and
/// the dq of its group of query heads.
struct KvHeadGrads<'a> {
    dq: &'a mut [f64],
    dk: &'a mut [f64],
    dv: &'a mut [f64],
}

/// The gradients of `attention`: `dv = pᵀ dout`, `ds = p (dout vᵀ - Σ_j p dp)` (from the
/// unrounded `p`), `dq = ds k · scale`, `dk = dsᵀ q · scale`; in bf16 the products read `p` and
/// `ds` rounded to bf16 (`as_product_operand`). `p` is rebuilt from the forward's statistics
/// where they are given (`[B, Hq, S, 2]`, `Op::AttentionBackward`'s `stats`), else softmaxed again.
fn attention_backward(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    dout: &HostTensor,
    stats: Option<&[f64]>,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let bf16 = q.ty.dtype == DType::BF16;
    let dims = AttnDims::of(q, k);
    let (s, d, group) = (dims.s, dims.d, dims.group());
    let head = s * d;
    let mut dq = vec![0.0; q.data.len()];
    let mut dk = vec![0.0; k.data.len()];
    let mut dv = vec![0.0; v.data.len()];
    if head == 0 {
        return (dq, dk, dv);
    }
    // One item per (batch, kv head): it owns that head's dk and dv and the dq of the query heads
    // reading it, which are contiguous, so the group's sums never cross threads.
    let items: Vec<KvHeadGrads> = dq
        .chunks_mut(group * head)
        .zip(dk.chunks_mut(head).zip(dv.chunks_mut(head)))
        .map(|(dq, (dk, dv))| KvHeadGrads { dq, dk, dv })
        .collect();
    let work = 8 * q.data.len() * s;
    let items: Vec<(usize, KvHeadGrads)> = items.into_iter().enumerate().collect();
    par_for_each(items, num_threads(), work, |(bkv, grads)| {
        let KvHeadGrads {
            dq: dq_g,
            dk: dk_h,
            dv: dv_h,
        } = grads;
        let kh = &k.data[bkv * head..][..head];
        let vh = &v.data[bkv * head..][..head];
        let mut p = vec![0.0; s];
        let mut dp = vec![0.0; s];
        for g in 0..group {
            let bh = bkv * group + g;
            let qh = &q.data[bh * head..][..head];
            let doh = &dout.data[bh * head..][..head];
            let dqh = &mut dq_g[g * head..(g + 1) * head];
            for i in 0..s {
                let len = if causal { i + 1 } else { s };
                let qi = &qh[i * d..(i + 1) * d];
                let doi = &doh[i * d..(i + 1) * d];
                match stats {
                    Some(stats) => {
                        let row = &stats[2 * (bh * s + i)..][..2];
                        dims.probs_from(qi, kh, len, scale, (row[0], row[1]), &mut p);
                    }
                    None => {
                        dims.probs(qi, kh, len, scale, &mut p);
                    }
                }
                let mut t = 0.0;
                for j in 0..len {
                    dp[j] = dot(doi, &vh[j * d..(j + 1) * d]);
                    t += p[j] * dp[j];
                }
                let dqi = &mut dqh[i * d..(i + 1) * d];
                for j in 0..len {
                    let ds = as_product_operand(p[j] * (dp[j] - t), bf16);
                    let pj = as_product_operand(p[j], bf16);
                    let kj = &kh[j * d..(j + 1) * d];
                    for c in 0..d {
                        dqi[c] += ds * kj[c];
                    }
                    let sds = scale * ds;
                    for (dkc, &qc) in dk_h[j * d..(j + 1) * d].iter_mut().zip(qi) {
                        *dkc += sds * qc;
                    }
                    for (dvc, &oc) in dv_h[j * d..(j + 1) * d].iter_mut().zip(doi) {
                        *dvc += pj * oc;
                    }
                }
                for c in dqi {
                    *c *= scale;
                }
            }
        }
    });
    (dq, dk, dv)
}

/// Softmax (or log-softmax) along `axis`, subtracting the max first.
fn softmax(x: &HostTensor, axis: usize, log: bool) -> Vec<f64> {
    let shape = x.shape();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out = vec![0.0; x.data.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| o * n * inner + j * inner + i;
            let max = (0..n).fold(f64::NEG_INFINITY, |m, j| {
                BinaryOp::Max.apply(m, x.data[at(j)])
            });
            let sum: f64 = (0..n).map(|j| (x.data[at(j)] - max).exp()).sum();
            for j in 0..n {
                let shifted = x.data[at(j)] - max;
                out[at(j)] = if log {
                    shifted - sum.ln()
                } else {
                    shifted.exp() / sum
                };
            }
        }
    }
    out
}

/// `(max, sum(exp(row - max)))` of a logits row.
fn row_max_sum(row: &[f64]) -> (f64, f64) {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| BinaryOp::Max.apply(m, v));
    (max, row.iter().map(|v| (v - max).exp()).sum())
}

fn cross_entropy(logits: &HostTensor, targets: &HostTensor) -> Result<f64, String> {
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    let mut total = 0.0;
    for (r, &t) in targets.data.iter().enumerate() {
        let t = check_index(t, vocab, "target", r, targets.shape())?;
        let row = &logits.data[r * vocab..(r + 1) * vocab];
        let (max, sum) = row_max_sum(row);
        total += max + sum.ln() - row[t];
    }
    Ok(total / rows as f64)
}

fn cross_entropy_backward(
    logits: &HostTensor,
    targets: &HostTensor,
    g: f64,
) -> Result<Vec<f64>, String> {
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    let mut out = Vec::with_capacity(logits.data.len());
    for (r, &t) in targets.data.iter().enumerate() {
        let t = check_index(t, vocab, "target", r, targets.shape())?;
        let row = &logits.data[r * vocab..(r + 1) * vocab];
        let (max, sum) = row_max_sum(row);
        out.extend(row.iter().enumerate().map(|(j, &v)| {
            let onehot = if j == t { 1.0 } else { 0.0 };
            ((v - max).exp() / sum - onehot) * g / rows as f64
        }));
    }
    Ok(out)
}

/// torch.optim.AdamW's update; inputs `(p, g, m, v, lr, step)`, outputs `(p', m', v')` unrounded.
fn adamw(
    ins: &[&HostTensor],
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (p, g, m, v) = (&ins[0].data, &ins[1].data, &ins[2].data, &ins[3].data);
    let lr = ins[4].data.first().copied().unwrap_or(f64::NAN);
    let t = ins[5].data.first().copied().unwrap_or(f64::NAN);
    let bc1 = 1.0 - b1.powf(t);
    let bc2 = 1.0 - b2.powf(t);
    let mut p_out = Vec::with_capacity(p.len());
    let mut m_out = Vec::with_capacity(p.len());
    let mut v_out = Vec::with_capacity(p.len());
    for i in 0..p.len() {
        let m1 = b1 * m[i] + (1.0 - b1) * g[i];
        // As torch's `addcmul_(g, g, value=1 - b2)`: the square first, then the scale.
        let v1 = b2 * v[i] + (1.0 - b2) * (g[i] * g[i]);
        let p1 = p[i] * (1.0 - lr * wd);
        p_out.push(p1 - (lr / bc1) * m1 / (v1.sqrt() / bc2.sqrt() + eps));
        m_out.push(m1);
        v_out.push(v1);
    }
    (p_out, m_out, v_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn det(seed: u64, len: usize) -> Vec<f64> {
        (0..len).map(|i| rng::normal(seed, 0, i as u64)).collect()
    }

    fn naive(
        a: &[f64],
        b: &[f64],
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        shared: bool,
    ) -> Vec<f64> {
        let mut c = vec![0.0; batch * m * n];
        for bi in 0..batch {
            let bb = if shared { 0 } else { bi * k * n };
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for kk in 0..k {
                        s += a[bi * m * k + i * k + kk] * b[bb + kk * n + j];
                    }
                    c[bi * m * n + i * n + j] = s;
                }
            }
        }
        c
    }

    #[test]
    fn matmul_matches_the_naive_sum_bit_for_bit_at_any_thread_count() {
        // Odd sizes exercise leftover rows, a padded panel and a second k block.
        for &(batch, m, k, n, shared) in &[
            (1, 7, 300, 13, true),
            (3, 9, 5, 17, false),
            (2, 70, 260, 9, true),
            (1, 1, 1, 1, false),
        ] {
            let a = det(1, batch * m * k);
            let b = det(2, if shared { k * n } else { batch * k * n });
            let want = naive(&a, &b, batch, m, k, n, shared);
            for threads in [1, 2, 3, 8] {
                let got = matmul_raw(&a, &b, batch, m, k, n, shared, threads);
                assert_eq!(
                    got, want,
                    "batch {batch} m {m} k {k} n {n} threads {threads}"
                );
            }
        }
    }

    #[test]
    fn matmul_of_empty_shapes_is_zeros() {
        assert_eq!(matmul_raw(&[], &[], 1, 2, 0, 3, true, 2), vec![0.0; 6]);
        assert!(matmul_raw(&[], &[0.0; 6], 1, 0, 2, 3, true, 2).is_empty());
    }

    #[test]
    fn parallel_for_each_visits_every_item_once() {
        let mut out = vec![0usize; 37];
        let items: Vec<(usize, &mut usize)> = out.iter_mut().enumerate().collect();
        par_for_each(items, 4, usize::MAX, |(i, slot)| *slot = i + 1);
        assert_eq!(out, (1..=37).collect::<Vec<_>>());
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and the next bf16 (1 + 2^-7): ties go to the even 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(1.0 + 1.5 / 256.0), 1.0 + 1.0 / 128.0);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
    }
}
