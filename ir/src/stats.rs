//! Static accounting of a train-step graph: node counts, FLOPs, bytes of parameters,
//! gradients, optimizer state and saved activations, and on a mesh the bytes a rank's
//! collectives send. Pure graph arithmetic: no execution.

use crate::graph::{Graph, InputKind, Phase};
use crate::op::{Collective, Op};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphStats {
    pub nodes: usize,
    /// Node count per phase, in phase order.
    pub nodes_per_phase: Vec<(Phase, usize)>,
    /// Node count per op name, sorted by name.
    pub nodes_per_op: Vec<(&'static str, usize)>,
    pub param_count: usize,
    pub param_bytes: usize,
    /// One gradient per parameter, at the parameter's dtype.
    pub grad_bytes: usize,
    pub state_bytes: usize,
    /// Forward/loss values that backward nodes read: what must stay alive between the passes.
    pub saved_activation_bytes: usize,
    /// FLOPs counted node by node (matmul 2MNK; attention 4·B·H·S²·D forward, 10·B·H·S²·D
    /// backward, dense, mask not skipped; elementwise and reductions one per element).
    pub flops: f64,
    pub flops_per_phase: Vec<(Phase, f64)>,
    /// On a mesh: per collective kind (its start's name), how many there are and the bytes one
    /// rank sends per step under a bandwidth-optimal (ring) algorithm (`comm_bytes`), by name.
    pub comm_per_collective: Vec<(&'static str, usize, f64)>,
}

/// Bytes one member of a group of `n` sends for `collective` on an operand of `bytes` bytes,
/// under the bandwidth-optimal (ring) algorithms: all-gather (n - 1)·x (each other member's
/// block passes once), reduce-scatter and all-to-all (n - 1)/n·x, all-reduce 2(n - 1)/n·x
/// (a reduce-scatter then an all-gather), broadcast x (the root's, in a pipelined chain). A
/// model of a network's traffic, not what the in-process threads launcher copies.
pub fn comm_bytes(collective: Collective, n: usize, bytes: usize) -> f64 {
    let (n, x) = (n as f64, bytes as f64);
    if n <= 1.0 {
        return 0.0;
    }
    match collective {
        Collective::AllGather { .. } => (n - 1.0) * x,
        Collective::ReduceScatter { .. } | Collective::AllToAll { .. } => (n - 1.0) / n * x,
        Collective::AllReduce { .. } => 2.0 * (n - 1.0) / n * x,
        Collective::Broadcast { .. } => x,
    }
}

/// FLOPs of one node.
pub fn node_flops(g: &Graph, node: &crate::graph::Node) -> f64 {
    let ty = |i: usize| g.ty(node.inputs[i]);
    let out_numel = node.outputs.first().map(|o| g.ty(*o).numel()).unwrap_or(0) as f64;
    match &node.op {
        Op::Matmul => {
            let a = ty(0);
            let k = a.shape[a.rank() - 1] as f64;
            2.0 * out_numel * k
        }
        Op::Attention { .. } | Op::AttentionBackward { .. } => {
            let q = ty(0);
            let (b, h, s, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
            let dense = (b * h * s * s * d) as f64;
            if matches!(node.op, Op::Attention { .. }) {
                4.0 * dense
            } else {
                10.0 * dense
            }
        }
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Expand { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => 0.0,
        Op::Full { .. } | Op::Iota { .. } | Op::Offload | Op::Reload => 0.0,
        // Communication moves bytes; it computes nothing worth counting as FLOPs.
        Op::CollectiveStart { .. } | Op::Wait => 0.0,
        Op::Embedding | Op::Gather { .. } => 0.0,
        _ => node
            .inputs
            .iter()
            .map(|v| g.ty(*v).numel())
            .max()
            .unwrap_or(0)
            .max(out_numel as usize) as f64,
    }
}

impl GraphStats {
    pub fn of(g: &Graph) -> GraphStats {
        let mut s = GraphStats {
            nodes: g.nodes.len(),
            nodes_per_op: g.op_histogram(),
            ..Default::default()
        };
        let mut per_phase: BTreeMap<Phase, (usize, f64)> = BTreeMap::new();
        for n in &g.nodes {
            let f = node_flops(g, n);
            let e = per_phase.entry(n.meta.phase).or_default();
            e.0 += 1;
            e.1 += f;
            s.flops += f;
        }
        let mut comm: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
        for n in &g.nodes {
            if let Op::CollectiveStart {
                collective, group, ..
            } = &n.op
            {
                let e = comm.entry(collective.start_name()).or_default();
                e.0 += 1;
                e.1 += comm_bytes(*collective, *group, g.ty(n.inputs[0]).size_bytes());
            }
        }
        s.comm_per_collective = comm.into_iter().map(|(k, (c, b))| (k, c, b)).collect();
        s.nodes_per_phase = per_phase.iter().map(|(p, (c, _))| (*p, *c)).collect();
        s.flops_per_phase = per_phase.iter().map(|(p, (_, f))| (*p, *f)).collect();
        for i in &g.inputs {
            let t = g.ty(i.value);
            match i.kind {
                InputKind::Param => {
                    s.param_count += t.numel();
                    s.param_bytes += t.size_bytes();
                    s.grad_bytes += t.size_bytes();
                }
                InputKind::State => s.state_bytes += t.size_bytes(),
                InputKind::Data => {}
            }
        }
        let producers = g.producers();
        let users = g.users();
        for (v, prod) in producers.iter().enumerate() {
            let Some(p) = prod else { continue };
            if g.nodes[*p].meta.phase > Phase::Loss {
                continue;
            }
            if users[v]
                .iter()
                .any(|&u| g.nodes[u].meta.phase >= Phase::Backward)
            {
                s.saved_activation_bytes += g.values[v].size_bytes();
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Reduce;

    #[test]
    fn ring_volumes_per_member() {
        let mib = 1 << 20;
        // Four members, 1 MiB operands.
        assert_eq!(
            comm_bytes(Collective::AllGather { axis: 0 }, 4, mib),
            3.0 * mib as f64
        );
        let rs = Collective::ReduceScatter {
            axis: 0,
            reduce: Reduce::Sum,
        };
        assert_eq!(comm_bytes(rs, 4, mib), 0.75 * mib as f64);
        let ar = Collective::AllReduce {
            reduce: Reduce::Avg,
        };
        assert_eq!(comm_bytes(ar, 4, mib), 1.5 * mib as f64);
        assert_eq!(
            comm_bytes(Collective::Broadcast { root: 0 }, 4, mib),
            mib as f64
        );
        // A group of one sends nothing.
        assert_eq!(comm_bytes(ar, 1, mib), 0.0);
    }
}
