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

use crate::sim::hardware::{Hardware, Kind};
use crate::sim::{link_for, Links};
use graphtrain_ir::stats::{comm_bytes, node_flops};
use graphtrain_ir::{DType, Graph, Mesh, Op};

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

/// The rates one rank works at on `hw`.
pub struct Rates<'a> {
    hw: &'a Hardware,
    links: Links,
    /// Ranks sharing one device's compute and memory (the world on a cpu host, else 1).
    share: f64,
}

impl<'a> Rates<'a> {
    pub fn new(hw: &'a Hardware, links: Links, world: usize) -> Rates<'a> {
        let share = match hw.kind {
            Kind::Cpu => world as f64,
            Kind::Gpu => 1.0,
        };
        Rates { hw, links, share }
    }

    fn bandwidth(&self) -> f64 {
        self.hw.memory_gbps * 1e9 * self.hw.efficiency.memory / self.share
    }

    fn flop_rate(&self, dtype: DType, efficiency: f64) -> f64 {
        let peak = match dtype {
            DType::BF16 => self.hw.peak_gflops_bf16,
            _ => self.hw.peak_gflops_f32,
        };
        peak * 1e9 * efficiency / self.share
    }

    /// Seconds of memory-bound work moving `bytes`.
    pub fn memory_seconds(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth()
    }

    /// Seconds of `collective` on an operand of `bytes` over `dims` of `mesh`, as rank 0's
    /// group runs it.
    pub fn collective_seconds(
        &self,
        collective: graphtrain_ir::op::Collective,
        mesh: &Mesh,
        dims: &[usize],
        bytes: f64,
    ) -> f64 {
        let group = mesh.group(0, dims);
        if group.len() <= 1 {
            return 0.0;
        }
        let sent = comm_bytes(collective, group.len(), bytes as usize);
        link_for(self.hw, self.links, &group).seconds(sent)
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
                let efficiency = match op {
                    Op::Matmul => rates.hw.efficiency.matmul,
                    Op::Attention { .. } | Op::AttentionBackward { .. } => {
                        rates.hw.efficiency.attention
                    }
                    _ => rates.hw.efficiency.memory,
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
