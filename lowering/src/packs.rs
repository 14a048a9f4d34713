//! Parameters stored side by side: a concat of graph inputs along their first axis is read in
//! place instead of copied.
//!
//! Why: `merge_matmuls` reads a block's `wq`, `wk` and `wv` as one `[3d, d]` weight,
//! `concat(wq, wk, wv, axis=0)`, while the parameters stay separate graph inputs (their names,
//! checkpoints, sharding and updates are per parameter). Row-major tensors concatenated along
//! axis 0 are their bytes one after the other, so where the planner places the inputs so, the
//! concat is that memory, and its readers read it with no step.
//!
//! Chosen (fused lowering only; eager copies, the numerics baseline): a `concat` along axis 0
//! whose operands are distinct graph inputs of one dtype, none in another pack, each a whole
//! number of `ARENA_ALIGN` blocks (so the parts keep the arena's alignment, and the plan needs
//! no padding between them), the concat not a graph output, and every read of the concat
//! (directly or through layout ops and casts, which may become views of it) scheduled before
//! any node that writes a part in place (the optimizer's donated updates): the concat is the
//! parts' values as they were when it was computed.
//!
//! The planner (`buffer_plan.rs`) then holds a pack's parts, the outputs donated into them, and
//! the concat in one buffer: part `i` at the sum of the earlier parts' bytes, the concat at 0.

use crate::program::ARENA_ALIGN;
use graphtrain_ir::{Graph, Op, ValueId};

/// A concat read in place: `concat` is `parts` in memory order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pack {
    /// The node computing the concat, which emits no step.
    pub node: usize,
    pub concat: ValueId,
    pub parts: Vec<ValueId>,
}

/// The concats of `g` stored as their operands side by side (`elem_bytes` per element).
pub(crate) fn find_packs(g: &Graph, elem_bytes: usize) -> Vec<Pack> {
    let producers = g.producers();
    let users = g.users();
    let is_output = |v: ValueId| g.outputs.iter().any(|o| o.value == v);
    // The first node writing each input's bytes in place (its donated output's producer).
    let mut written_at = vec![usize::MAX; g.values.len()];
    for o in &g.outputs {
        if let (Some(input), Some(p)) = (o.donates, producers[o.value.index()]) {
            written_at[input.index()] = written_at[input.index()].min(p);
        }
    }
    // The last node that may read `v`'s memory: its readers, and the readers of layout ops and
    // casts over it, any of which the fused lowering may turn into a view of `v`.
    let last_read = |v: ValueId| {
        let mut last = 0;
        let mut stack = vec![v];
        while let Some(v) = stack.pop() {
            for &u in &users[v.index()] {
                last = last.max(u);
                if matches!(
                    g.nodes[u].op,
                    Op::Reshape { .. }
                        | Op::Transpose { .. }
                        | Op::Slice { .. }
                        | Op::Expand { .. }
                        | Op::Cast { .. }
                ) {
                    stack.push(g.nodes[u].outputs[0]);
                }
            }
        }
        last
    };
    let mut taken = vec![false; g.values.len()];
    let mut packs = Vec::new();
    for (k, n) in g.nodes.iter().enumerate() {
        if n.op != (Op::Concat { axis: 0 }) || is_output(n.outputs[0]) {
            continue;
        }
        let dtype = g.ty(n.inputs[0]).dtype;
        let mut distinct = n.inputs.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let parts_fit = distinct.len() == n.inputs.len()
            && n.inputs.iter().all(|&p| {
                producers[p.index()].is_none()
                    && !taken[p.index()]
                    && g.ty(p).dtype == dtype
                    && (g.ty(p).numel() * elem_bytes).is_multiple_of(ARENA_ALIGN)
            });
        if !parts_fit {
            continue;
        }
        let first_write = n.inputs.iter().map(|p| written_at[p.index()]).min();
        if first_write.is_some_and(|w| last_read(n.outputs[0]) >= w) {
            continue;
        }
        for p in &n.inputs {
            taken[p.index()] = true;
        }
        packs.push(Pack {
            node: k,
            concat: n.outputs[0],
            parts: n.inputs.clone(),
        });
    }
    packs
}
