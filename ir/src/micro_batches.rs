//! Gradient accumulation as graph structure: the step's batch split into micro-batches that run
//! one after another, each its own forward, loss and backward, their gradients summed before the
//! one optimizer update.
//!
//! Why in the graph: the step is one graph, with no loop around a forward and backward to run
//! them several times, and a forward traced over the whole batch keeps all of its activations
//! live until the backward. Here the forward is traced at the micro-batch's size and copied once
//! per micro-batch, each copy reading its rows of the batch (slices of the data inputs, which
//! stay the whole batch) and followed by its own backward: a micro-batch's activations die in
//! its backward, before the next micro-batch's forward starts, and the buffer planner's liveness
//! reuses their memory. The optimizer, its gradient reductions and the checkpointed state are
//! those of an unsplit step.
//!
//! Contract (`forward_and_backward`):
//! - every data input (`InputKind::Data`) gains a second axis of `n`, the micro-batch: the
//!   traced `[rows, ..]` becomes `[rows, n, ..]`, which holds the whole batch `[rows * n, ..]`
//!   in the same order: micro-batch `k` reads rows `k, n + k, 2n + k, ..` of the whole batch
//!   (any equal split gives the same mean; this one keeps each rank's rows of a data-parallel
//!   batch the contiguous block they are unsplit, and the row axis first, as `Shard(0)` places
//!   it). Names and kinds are unchanged; a placement sharding a later axis shards it one axis
//!   on. Parameters and every other input are shared by the copies;
//! - the loss returned is the mean of the micro-batches' losses and the gradients are those of
//!   that mean (each backward starts from `seed / n`), summed micro-batch by micro-batch in
//!   order. With a loss that is a mean over its rows (cross-entropy over equal micro-batches),
//!   that is the whole batch's loss and gradient, up to the order of the sums;
//! - every node appended carries `micro_batch = Some(k)`, so the schedule runs micro-batch 0's
//!   forward, loss and backward, then micro-batch 1's, and so on (`Meta::stage`); the loss's
//!   mean and the last sums belong to the last micro-batch.
//!
//! Refuses (`BuildError::MicroBatches`): fewer than two micro-batches (the caller builds an
//! unsplit step), a data input without a batch axis, and a forward already split.

use crate::autodiff::{grad_with, GradOptions};
use crate::graph::{Graph, InputKind, Meta, Phase, ValueId};
use crate::mesh::Placement;
use crate::op::{BinaryOp, Op};
use crate::optim::BuildError;

/// The forward and backward of `n` micro-batches (this module's contract): the graph, the
/// mean loss and the summed gradient of each of `params`, in order. `seed` is the cotangent an
/// unsplit backward would start from, `seed_partial` as `GradOptions::seed_partial`.
pub fn forward_and_backward(
    forward: Graph,
    loss: ValueId,
    params: &[ValueId],
    n: u32,
    seed: f64,
    seed_partial: Option<(Vec<usize>, usize)>,
) -> Result<(Graph, ValueId, Vec<ValueId>), BuildError> {
    let refuse = |message: String| Err(BuildError::MicroBatches(message));
    if n < 2 {
        return refuse(format!("{n} micro-batches: a split step has at least two"));
    }
    if forward.micro_batches() > 1 {
        return refuse("the forward is already split into micro-batches".into());
    }
    let mut g = forward;
    let traced_nodes = std::mem::take(&mut g.nodes);
    g.outputs.clear();
    // (input, its traced shape): each widened to `[rows, n, ..]`, its shards past the rows one
    // axis on.
    let mut split = Vec::new();
    for input in &mut g.inputs {
        if input.kind != InputKind::Data {
            continue;
        }
        let ty = &mut g.values[input.value.index()];
        if ty.rank() == 0 {
            return refuse(format!(
                "the data input `{}` is {ty}, with no batch axis to split",
                input.name
            ));
        }
        let traced = ty.shape.clone();
        ty.shape.insert(1, n as usize);
        if let Some(placements) = &mut input.placement {
            for p in &mut placements.0 {
                if let Placement::Shard(axis) = p {
                    if *axis > 0 {
                        *axis += 1;
                    }
                }
            }
        }
        split.push((input.value, traced));
    }
    let traced_values = g.values.len();
    let opts = GradOptions {
        seed: Some(seed / f64::from(n)),
        seed_partial,
        ..GradOptions::default()
    };
    let mut losses = Vec::with_capacity(n as usize);
    let mut grads: Vec<ValueId> = Vec::new();
    for k in 0..n {
        let first_node = g.nodes.len();
        // What each traced value is in this micro-batch: inputs are shared, the data inputs'
        // rows sliced, every node copied.
        let mut map: Vec<ValueId> = (0..traced_values as u32).map(ValueId).collect();
        let meta = Meta::new("micro_batches.rows", Phase::Forward);
        for (input, traced) in &split {
            let k = k as usize;
            let rows = g.push1(
                Op::Slice {
                    axis: 1,
                    start: k,
                    end: k + 1,
                },
                vec![*input],
                meta.clone(),
            )?;
            // The micro-batch's unit axis moved last before it is dropped, so that the axes
            // before every other one stay as they were: a reshape that drops a unit axis in
            // front of a split axis of local size 1 is ambiguous to placement propagation.
            let mut last: Vec<usize> = (0..=traced.len()).filter(|&a| a != 1).collect();
            last.push(1);
            let rows = g.push1(Op::Transpose { perm: last }, vec![rows], meta.clone())?;
            map[input.index()] = g.push1(
                Op::Reshape {
                    shape: traced.clone(),
                },
                vec![rows],
                meta.clone(),
            )?;
        }
        for node in &traced_nodes {
            let inputs = node.inputs.iter().map(|v| map[v.index()]).collect();
            let outputs = g.push(node.op.clone(), inputs, node.meta.clone())?;
            for (traced, copy) in node.outputs.iter().zip(outputs) {
                map[traced.index()] = copy;
            }
        }
        let loss_k = map[loss.index()];
        let grads_k = grad_with(&mut g, loss_k, params, &opts)?;
        grads = if grads.is_empty() {
            grads_k
        } else {
            let meta = Meta::new("micro_batches.grad_sum", Phase::Backward);
            grads
                .iter()
                .zip(grads_k)
                .map(|(&sum, grad)| {
                    g.push1(Op::Binary(BinaryOp::Add), vec![sum, grad], meta.clone())
                })
                .collect::<Result<_, _>>()?
        };
        losses.push(loss_k);
        if k == n - 1 {
            let meta = Meta::new("micro_batches.loss_mean", Phase::Backward);
            let mut sum = losses[0];
            for &l in &losses[1..] {
                sum = g.push1(Op::Binary(BinaryOp::Add), vec![sum, l], meta.clone())?;
            }
            let mean = g.push1(
                Op::MulScalar {
                    value: 1.0 / f64::from(n),
                },
                vec![sum],
                meta,
            )?;
            losses.push(mean);
        }
        for node in &mut g.nodes[first_node..] {
            node.meta.micro_batch = Some(k);
        }
    }
    let mean = *losses.last().expect("the mean of the losses");
    Ok((g, mean, grads))
}
