//! Placement propagation: the placement of every value of an SPMD graph, from the placements of
//! its inputs, one rule per op and mesh dimension. The verifier runs it to check that each op can
//! take its operands' placements directly (where it cannot, the graph needs a redistribution, a
//! collective, in between) and that declared output placements are what the graph computes.
//!
//! Each rule states what a rank's local op computes of the global values. On one mesh dimension:
//! - `replicate` operands give a `replicate` result;
//! - an op that works independently along a dimension (rows of a matmul, the batch of attention)
//!   keeps a `shard` of that dimension;
//! - an op that sums over a sharded dimension (a matmul's contraction, `reduce_sum`) gives
//!   `partial(sum)`; a mean over rows sharded in equal blocks (`cross_entropy`) gives
//!   `partial(avg)`;
//! - an op linear in one operand keeps that operand's `partial` when the others are replicated
//!   (the sum of the ranks' results is the result of the sum).
//!
//! Rules exist for the ops of the Llama train step (forward, backward, optimizer) and for every
//! collective; a value computed by an op without a rule, or from an input declared without a
//! placement, has an unknown placement, and nothing that depends on it is checked
//! (`Propagation::unknown` names the first op without a rule).

use crate::graph::Graph;
use crate::mesh::{Mesh, Placement, Placements, Reduce};
use crate::op::{BinaryOp, Collective, Op, UnaryOp};
use crate::{DType, TensorType};

use Placement::{Partial, Replicate, Shard};

/// The placements of a graph's values (`None` where unknown) and the first op without a rule.
pub struct Propagation {
    pub placements: Vec<Option<Placements>>,
    /// The first node whose outputs have no placement because its op has no rule.
    pub unknown: Option<usize>,
}

/// Propagates the input placements of `g` (which must have a mesh) through its nodes. An input
/// without a placement has an unknown one, and so has everything computed from it (sources
/// such as `full` are replicated). Fails at the first node that cannot take its operands'
/// placements, naming the node.
pub fn propagate(g: &Graph, mesh: &Mesh) -> Result<Propagation, (usize, String)> {
    let mut placements: Vec<Option<Placements>> = vec![None; g.values.len()];
    for input in &g.inputs {
        placements[input.value.index()] = input.placement.clone();
    }
    let mut unknown = None;
    for (i, node) in g.nodes.iter().enumerate() {
        let ins: Option<Vec<&Placements>> = node
            .inputs
            .iter()
            .map(|v| placements[v.index()].as_ref())
            .collect();
        let Some(ins) = ins else { continue };
        let types: Vec<&TensorType> = node.inputs.iter().map(|v| g.ty(*v)).collect();
        let out_types: Vec<&TensorType> = node.outputs.iter().map(|v| g.ty(*v)).collect();
        match node_rule(&node.op, &ins, &types, &out_types, mesh) {
            Ok(Some(outs)) => {
                for (v, p) in node.outputs.iter().zip(outs) {
                    placements[v.index()] = Some(p);
                }
            }
            Ok(None) => {
                unknown.get_or_insert(i);
            }
            Err(m) => return Err((i, m)),
        }
    }
    Ok(Propagation {
        placements,
        unknown,
    })
}

/// The output placements of one node, `None` when the op has no rule.
pub fn node_rule(
    op: &Op,
    ins: &[&Placements],
    types: &[&TensorType],
    out_types: &[&TensorType],
    mesh: &Mesh,
) -> Result<Option<Vec<Placements>>, String> {
    let n_out = op.num_outputs();
    let mut outs = vec![Vec::with_capacity(mesh.dims.len()); n_out];
    for (m, dim) in mesh.dims.iter().enumerate() {
        if let Op::ToPartial { mesh_dims, .. } = op {
            let p = ins[0].0[m];
            outs[0].push(match p {
                _ if !mesh_dims.contains(&m) => p,
                Replicate => Partial(Reduce::Sum),
                _ => {
                    return Err(format!(
                        "to_partial of a value placed {p} on mesh dimension `{}`: only a replicated value can be split into a partial sum",
                        dim.name
                    ))
                }
            });
            continue;
        }
        if let Op::CollectiveStart { mesh_dims, .. } = op {
            if !mesh_dims.contains(&m) {
                // Untouched mesh dims keep their placement, unless they shard an axis the
                // collective changes.
                let p = ins[0].0[m];
                if let (Shard(d), Some(axes)) = (p, collective_axes(op)) {
                    if axes.contains(&d) {
                        return Err(format!(
                            "{} changes axis {d}, which {} also shards ({p}): the blocks would interleave",
                            op.name(),
                            dim.name
                        ));
                    }
                }
                outs[0].push(p);
                continue;
            }
        }
        let here: Vec<Placement> = ins.iter().map(|p| p.0[m]).collect();
        match dim_rule(op, &here, types, out_types) {
            Ok(Some(ps)) => {
                for (o, p) in outs.iter_mut().zip(ps) {
                    o.push(p);
                }
            }
            Ok(None) => return Ok(None),
            Err(e) => {
                let shown: Vec<String> = here.iter().map(|p| p.to_string()).collect();
                return Err(format!(
                    "cannot take operands placed ({}) on mesh dimension `{}`: {e}; a redistribution (collective) must come first",
                    shown.join(", "),
                    dim.name
                ));
            }
        }
    }
    Ok(Some(outs.into_iter().map(Placements).collect()))
}

fn collective_axes(op: &Op) -> Option<Vec<usize>> {
    match op {
        Op::CollectiveStart { collective, .. } => Some(match *collective {
            Collective::AllGather { axis } | Collective::ReduceScatter { axis, .. } => vec![axis],
            Collective::AllToAll {
                split_axis,
                concat_axis,
            } => vec![split_axis, concat_axis],
            Collective::AllReduce { .. } | Collective::Broadcast { .. } => Vec::new(),
        }),
        _ => None,
    }
}

type Rule = Result<Option<Vec<Placement>>, String>;

fn one(p: Placement) -> Rule {
    Ok(Some(vec![p]))
}

fn all_equal(ps: &[Placement]) -> Option<Placement> {
    ps.iter().all(|p| *p == ps[0]).then_some(ps[0])
}

/// The same placement on every operand, not partial: ops that are not linear.
fn same_not_partial(ps: &[Placement]) -> Rule {
    match all_equal(ps) {
        Some(Partial(_)) => {
            Err("the op is not linear, so partial values cannot go through it".into())
        }
        Some(p) => one(p),
        None => Err("operands must be placed alike".into()),
    }
}

/// A cast between float types.
fn float_cast(from: DType, to: DType) -> bool {
    from.is_float() && to.is_float()
}

/// A shard of `d` survives an op that works independently along dims `free`.
fn keep_shard_on(p: Placement, free: &[usize], what: &str) -> Result<Placement, String> {
    match p {
        Shard(d) if !free.contains(&d) => Err(format!("{what} cannot be split along axis {d}")),
        Partial(_) => Err(format!("{what} is not linear")),
        p => Ok(p),
    }
}

/// The output dimension that split input dimension `d` of a reshape from `from` to `to` (local
/// shapes) becomes, when a contiguous block of it stays a contiguous block: `d` is kept, or is
/// the outermost of the dimensions merged into one, or splits into dimensions of which the
/// outermost carries the block. `None` for any other regrouping.
fn reshape_dim(from: &[usize], to: &[usize], d: usize) -> Option<usize> {
    let keeps_block_at = |j: usize| {
        let product_from = |k: usize| from[d..(d + k).min(from.len())].iter().product::<usize>();
        let product_to = |k: usize| to[j..(j + k).min(to.len())].iter().product::<usize>();
        let merged = (1..=from.len() - d).any(|k| product_from(k) == to[j]);
        let split = (1..=to.len() - j).any(|k| product_to(k) == from[d]);
        merged || split
    };
    // Where the dimensions before `d` are unchanged, `d` stays at its place: local dimensions
    // of size 1 before it (one batch row per rank) do not make an earlier one the split one.
    if d < to.len() && to[..d] == from[..d] && keeps_block_at(d) {
        return Some(d);
    }
    let before: usize = from[..d].iter().product();
    let mut prefix = 1;
    let j = (0..to.len()).find(|&j| {
        // The first match: a dimension of local size 1 may be the split one (one row per rank).
        let here = prefix == before;
        prefix *= to[j];
        here
    })?;
    keeps_block_at(j).then_some(j)
}

fn dim_rule(op: &Op, p: &[Placement], types: &[&TensorType], out_types: &[&TensorType]) -> Rule {
    let rank = |i: usize| types[i].rank();
    match op {
        Op::Unary(UnaryOp::Neg) | Op::MulScalar { .. } | Op::Offload | Op::Reload | Op::Wait => {
            one(p[0])
        }
        // Float to float casts let partial values through. Widening is exact on every element:
        // the widened partials sum to the widened sum, computed in the wider type (mixed
        // precision's bf16 weight gradients, partial over the data-parallel ranks, are reduced
        // in f32, as FSDP's are). Narrowing rounds each partial instead of their sum: the
        // gradient of a bf16 matmul's output under tensor parallelism is summed in bf16, as
        // Megatron's is, and differs from one device's by that rounding.
        Op::Cast { dtype } if float_cast(types[0].dtype, *dtype) => one(p[0]),
        Op::Unary(_) | Op::AddScalar { .. } | Op::PowScalar { .. } | Op::Cast { .. } => {
            same_not_partial(p)
        }
        Op::Binary(b) => match (b, p[0], p[1]) {
            (BinaryOp::Add | BinaryOp::Sub, a, c) if a == c => one(a),
            (BinaryOp::Mul, Partial(r), Replicate) | (BinaryOp::Mul, Replicate, Partial(r)) => {
                one(Partial(r))
            }
            (BinaryOp::Div, Partial(r), Replicate) => one(Partial(r)),
            _ => same_not_partial(p),
        },
        Op::Compare(_) | Op::Select => same_not_partial(p),
        Op::ReduceSum { axes, keepdim } | Op::ReduceMax { axes, keepdim } => {
            let sum = matches!(op, Op::ReduceSum { .. });
            let kept = |d: usize| {
                if *keepdim {
                    d
                } else {
                    d - axes.iter().filter(|a| **a < d).count()
                }
            };
            match p[0] {
                Shard(d) if axes.contains(&d) && sum => one(Partial(Reduce::Sum)),
                Shard(d) if axes.contains(&d) => {
                    Err(format!("a max over axis {d}, which is split"))
                }
                Shard(d) => one(Shard(kept(d))),
                Partial(r) if sum => one(Partial(r)),
                Partial(_) => Err("a max of partial values".into()),
                Replicate => one(Replicate),
            }
        }
        Op::Reshape { shape } => match p[0] {
            Shard(d) => match reshape_dim(&types[0].shape, shape, d) {
                Some(j) => one(Shard(j)),
                None => Err(format!(
                    "the reshape {} -> {:?} does not keep split axis {d} contiguous",
                    types[0], shape
                )),
            },
            other => one(other),
        },
        Op::Transpose { perm } => match p[0] {
            Shard(d) => one(Shard(perm.iter().position(|&x| x == d).unwrap_or(d))),
            other => one(other),
        },
        Op::Expand { shape } => match p[0] {
            Shard(d) if types[0].shape[d] != shape[d] => {
                Err(format!("axis {d} is split but expanded"))
            }
            other => one(other),
        },
        Op::Slice { axis, .. } => match p[0] {
            Shard(d) if d == *axis => Err(format!("a slice along split axis {d}")),
            other => one(other),
        },
        Op::Concat { axis } => match all_equal(p) {
            Some(Shard(d)) if d == *axis => Err(format!("a concat along split axis {d}")),
            Some(q) => one(q),
            None => Err("operands must be placed alike".into()),
        },
        Op::Matmul => {
            let (ra, rb) = (rank(0), rank(1));
            let out_rank = out_types[0].rank();
            match (p[0], p[1]) {
                (Replicate, Replicate) => one(Replicate),
                // Rows (and batch) of the left operand.
                (Shard(d), Replicate) if d + 1 < ra && (rb == 2 || d + 2 < ra || d == ra - 2) => {
                    one(Shard(d))
                }
                (Shard(d), Shard(e)) if d + 2 < ra && d == e && rb == ra => one(Shard(d)),
                // Columns of the right operand.
                (Replicate, Shard(e)) if e == rb - 1 => one(Shard(out_rank - 1)),
                // The contraction: each rank sums its part of k.
                (Shard(d), Shard(e)) if d == ra - 1 && e == rb - 2 => one(Partial(Reduce::Sum)),
                (Partial(r), Replicate) | (Replicate, Partial(r)) => one(Partial(r)),
                _ => Err("these operands do not split a matmul".into()),
            }
        }
        Op::Full { .. } | Op::Iota { .. } | Op::RandomUniform { .. } | Op::RandomNormal { .. } => {
            one(Replicate)
        }
        Op::Embedding => match (p[0], p[1]) {
            (Replicate, ids) if !matches!(ids, Partial(_)) => one(ids),
            (Shard(1), Replicate) => one(Shard(rank(1))),
            _ => Err("the table may only be split along its embedding axis".into()),
        },
        Op::EmbeddingBackward { .. } => match (p[0], p[1]) {
            (Shard(d), Shard(e)) if d == e && d + 1 < rank(0) => one(Partial(Reduce::Sum)),
            (Shard(d), Replicate) if d + 1 == rank(0) => one(Shard(1)),
            (Partial(r), Replicate) => one(Partial(r)),
            (Replicate, Replicate) => one(Replicate),
            _ => Err("gradient rows and ids must be split alike".into()),
        },
        Op::RmsNorm { .. } => match (p[0], p[1]) {
            (x, Replicate) => one(keep_shard_on(
                x,
                &(0..rank(0) - 1).collect::<Vec<_>>(),
                "rms_norm",
            )?),
            _ => Err("the weight must be replicated".into()),
        },
        Op::RmsNormBackward { .. } => match (p[0], p[1], p[2]) {
            (Shard(d), Replicate, Shard(e)) if d == e && d + 1 < rank(0) => {
                Ok(Some(vec![Shard(d), Partial(Reduce::Sum)]))
            }
            (Replicate, Replicate, Replicate) => Ok(Some(vec![Replicate, Replicate])),
            (Replicate, Replicate, Partial(r)) => Ok(Some(vec![Partial(r), Partial(r)])),
            _ => Err(
                "x and its gradient must be split alike along rows, the weight replicated".into(),
            ),
        },
        // A rotation of each pair: linear, so a partial sum goes through.
        Op::Rope { .. } => match p[0] {
            Partial(r) => one(Partial(r)),
            x => one(keep_shard_on(
                x,
                &[0, 2],
                "rope (positions are the sequence index)",
            )?),
        },
        // The statistics are per query row: split as q (batch and heads).
        Op::Attention { stats, .. } => {
            let q = keep_shard_on(p[0], &[0, 1], "attention")?;
            if p[1] != q || p[2] != q {
                return Err("q, k and v must be split alike".into());
            }
            Ok(Some(vec![q; if *stats { 2 } else { 1 }]))
        }
        Op::AttentionBackward { stats, .. } => {
            let q = keep_shard_on(p[0], &[0, 1], "attention")?;
            if p[1] != q || p[2] != q {
                return Err("q, k and v must be split alike".into());
            }
            if *stats && p[4] != q {
                return Err("the forward's statistics must be split as q".into());
            }
            match (q, p[3]) {
                (q, g) if g == q => Ok(Some(vec![q; 3])),
                (Replicate, Partial(r)) => Ok(Some(vec![Partial(r); 3])),
                _ => Err("the output gradient must be split as q".into()),
            }
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let free: Vec<usize> = (0..rank(0)).filter(|d| d != axis).collect();
            one(keep_shard_on(p[0], &free, "softmax")?)
        }
        Op::CrossEntropy => match (p[0], p[1]) {
            // Equal blocks of rows: the mean of the ranks' means is the mean.
            (Shard(0), Shard(0)) => one(Partial(Reduce::Avg)),
            (Replicate, Replicate) => one(Replicate),
            _ => Err("logits and targets must both be split by rows, or replicated".into()),
        },
        Op::CrossEntropyBackward => match (p[0], p[1], p[2]) {
            (Shard(0), Shard(0), Replicate) => one(Shard(0)),
            (Replicate, Replicate, g) => one(g),
            _ => {
                Err("logits and targets must be split by rows, the loss gradient replicated".into())
            }
        },
        Op::AdamW { .. } | Op::Sgd { .. } => {
            let tensors = if matches!(op, Op::AdamW { .. }) { 4 } else { 2 };
            if p[tensors..].iter().any(|q| *q != Replicate) {
                return Err("the learning rate and step must be replicated".into());
            }
            let q = same_not_partial(&p[..tensors])?.expect("a rule")[0];
            Ok(Some(vec![q; op.num_outputs()]))
        }
        Op::CollectiveStart { collective, .. } => match (*collective, p[0]) {
            (Collective::AllGather { axis }, Shard(d)) if d == axis => one(Replicate),
            (Collective::AllGather { axis }, q) => Err(format!(
                "all_gather along axis {axis} of a value placed {q}"
            )),
            (Collective::ReduceScatter { axis, reduce }, Partial(r)) if r == reduce => {
                one(Shard(axis))
            }
            (Collective::AllReduce { reduce }, Partial(r)) if r == reduce => one(Replicate),
            (Collective::ReduceScatter { reduce, .. } | Collective::AllReduce { reduce }, q) => {
                Err(format!(
                    "a {} reduction of a value placed {q}",
                    reduce.name()
                ))
            }
            (
                Collective::AllToAll {
                    split_axis,
                    concat_axis,
                },
                Shard(d),
            ) if d == concat_axis => one(Shard(split_axis)),
            (Collective::AllToAll { concat_axis, .. }, q) => Err(format!(
                "all_to_all gathers axis {concat_axis}, but the value is placed {q}"
            )),
            (Collective::Broadcast { .. }, _) => one(Replicate),
        },
        Op::Gather { .. } | Op::ScatterAdd { .. } => Ok(None),
        Op::ToPartial { .. } => unreachable!("node_rule places to_partial itself"),
    }
}

#[cfg(test)]
mod reshape_tests {
    use super::reshape_dim;

    /// Where a split dimension goes through a reshape, including the cases size-1 dimensions
    /// make ambiguous: a kept prefix keeps the split dimension where it was.
    #[test]
    fn split_dimension_through_reshapes() {
        for (from, to, d, want) in [
            // A rank axis of local size 1 inserted before the rows, with one batch row.
            (&[1, 8, 32][..], &[1, 1, 8, 32][..], 1, Some(1)),
            (&[2, 8, 32][..], &[2, 1, 8, 32][..], 1, Some(1)),
            // An identity reshape keeps the split where it is, size-1 dimensions or not.
            (&[2, 1, 8][..], &[2, 1, 8][..], 2, Some(2)),
            // A dropped leading size-1 dimension.
            (&[1, 8, 32][..], &[8, 32][..], 1, Some(0)),
            // Merged as the outermost, and split with the block on the outer part.
            (&[8, 4][..], &[32][..], 0, Some(0)),
            (&[4, 8][..], &[4, 2, 4][..], 1, Some(1)),
            // The split dimension merged as an inner one: not one block per rank.
            (&[4, 8][..], &[32][..], 1, None),
        ] {
            assert_eq!(
                reshape_dim(from, to, d),
                want,
                "{from:?} -> {to:?}, dim {d}"
            );
        }
    }
}
