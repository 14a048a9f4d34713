//! The solver's cost model: one rank's SPMD train-step graph, before passes and fusion, priced
//! on a [`Hardware`] description, with the simulator's rates and links.
//!
//! - Compute: every node costs the larger of its FLOPs at the peak of its result's precision
//!   times the efficiency of its kind (matmul, attention) and the bytes it reads and writes at
//!   the memory bandwidth times the memory efficiency (a roofline per node). Layout ops (views)
//!   cost nothing: the lowering reads them in place.
//! - Communication: every collective costs its link's latency plus what one member sends under
//!   the ring algorithms (`graphtrain_ir::stats::comm_bytes`) over its bandwidth, on the link
//!   `sim::link_for` picks for its group.
//! - The two add up: nothing overlaps. The overlap passes (`prefetch`, `schedule`, `async_tp`)
//!   run after the plan is chosen and `graphtrain sim` prices what they hide; a plan that moves
//!   fewer bytes gives them less to hide.
//! - Memory: the liveness prediction of `passes::memory::profile` (peak bytes live on a rank).
//!
//! On a `Cpu` host the ranks share its cores and memory bandwidth, as in the simulator.

use crate::sim::Rates;
use graphtrain_ir::stats::node_flops;
use graphtrain_ir::{DType, Graph, Op};

/// What one rank's step costs under the model.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    pub compute_s: f64,
    pub comm_s: f64,
    pub collectives: usize,
    pub peak_bytes: f64,
    /// What stays on a rank from forward into backward: saved activations, parameters and
    /// optimizer state.
    pub held_bytes: f64,
}

impl Cost {
    /// The objective: compute and communication, serialized.
    pub fn seconds(&self) -> f64 {
        self.compute_s + self.comm_s
    }

    /// `self + k (other - self)`: a model of `k` more repeats of what `other` adds to `self`
    /// (one more transformer block), exact for the times, which add over nodes. The peak grows
    /// by what a block adds to the peak or by what it holds from forward into backward,
    /// whichever is more: with few blocks the peak may sit where the output head's logits
    /// are, with many where every block's saved activations are live.
    pub fn extrapolate(&self, other: &Cost, k: f64) -> Cost {
        let at = |a: f64, b: f64| a + k * (b - a);
        let held = at(self.held_bytes, other.held_bytes);
        Cost {
            compute_s: at(self.compute_s, other.compute_s),
            comm_s: at(self.comm_s, other.comm_s),
            collectives: at(self.collectives as f64, other.collectives as f64).round() as usize,
            peak_bytes: at(self.peak_bytes, other.peak_bytes)
                .max(self.peak_bytes + (held - self.held_bytes)),
            held_bytes: held,
        }
    }
}

/// Prices `g` (one rank's SPMD step).
pub fn graph_cost(g: &Graph, rates: &Rates) -> Cost {
    let mut cost = Cost::default();
    let bytes = |v: &graphtrain_ir::ValueId| g.values[v.index()].size_bytes() as f64;
    for node in &g.nodes {
        match &node.op {
            Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Wait => {}
            Op::CollectiveStart {
                collective,
                mesh_dims,
                ..
            } => {
                let mesh = g
                    .mesh
                    .as_ref()
                    .expect("a collective is in a graph with a mesh");
                cost.comm_s +=
                    rates.collective_seconds(*collective, mesh, mesh_dims, bytes(&node.inputs[0]));
                cost.collectives += 1;
            }
            op => {
                let moved: f64 = node.inputs.iter().map(bytes).sum::<f64>()
                    + node.outputs.iter().map(bytes).sum::<f64>();
                let efficiency = rates.hardware().efficiency;
                let efficiency = match op {
                    Op::Matmul => efficiency.matmul,
                    Op::Attention { .. } | Op::AttentionBackward { .. } => efficiency.attention,
                    _ => efficiency.memory,
                };
                let dtype = node.outputs.first().map_or(DType::F32, |o| g.ty(*o).dtype);
                let flops = node_flops(g, node);
                cost.compute_s +=
                    (flops / rates.flop_rate(dtype, efficiency)).max(rates.memory_seconds(moved));
            }
        }
    }
    let memory = graphtrain_passes::memory::profile(g);
    cost.peak_bytes = memory.peak_bytes as f64;
    cost.held_bytes = (memory.saved_device_bytes + memory.param_bytes + memory.state_bytes) as f64;
    cost
}
