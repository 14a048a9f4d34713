//! `prefetch`: starts each collective earlier, so that its communication overlaps the compute
//! before its wait (FSDP's all-gathers of the next weights while this block computes; TP's and
//! the gradients' collectives as soon as their operand exists).
//!
//! Changes: moves every collective start up to `nodes:N` nodes earlier (default 32), never
//! before the node that produces its operand nor out of its phase (a backward gather is not
//! issued in forward); layout nodes that only prepare the operand (a bucket's flattening and
//! concatenation) move up with it; waits stay where they are, right before the first use. Node
//! order is otherwise kept.
//! Guarantees: tier 1: no op, operand or result changes, only when a start is issued; every
//! rank runs the same graph, so every rank issues its collectives in the same (new) order, as
//! the communicators need. A start moved earlier holds its result buffer longer: the memory a
//! prefetch costs is bounded by the distance.
//! Declines: on a graph without a mesh or without collectives (nothing to move), saying so;
//! `nodes:0` is refused when the pass is built.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Graph, Op};

pub const INFO: PassInfo = PassInfo {
    name: "prefetch",
    tier: Tier::Preserving,
    summary: "start collectives earlier, so their communication overlaps compute",
    contract: "Moves every collective start up to N nodes earlier (option nodes:N, default 32), \
never before the node producing its operand nor out of its phase; waits stay right before their \
first use. Tier 1: \
only when a collective is issued changes, the same on every rank. A moved start holds its result \
buffer longer, so the distance bounds the memory it costs. Declines on a graph without \
collectives.",
    option_help: Some("nodes:N (N >= 1, default 32): how far, in nodes, a start may move earlier"),
};

/// How far a start moves by default: about a transformer block's forward nodes on `peer`.
const DEFAULT_NODES: usize = 32;

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| {
        let nodes = match option {
            None => DEFAULT_NODES,
            Some(o) => {
                let n = o
                    .strip_prefix("nodes:")
                    .ok_or_else(|| format!("prefetch: unknown option `{o}`; expected nodes:N"))?;
                match n.parse::<usize>() {
                    Ok(0) | Err(_) => {
                        return Err(format!(
                            "prefetch: `{o}`: N must be a whole number of nodes, at least 1"
                        ))
                    }
                    Ok(n) => n,
                }
            }
        };
        Ok(Box::new(Prefetch { nodes }))
    });
}

pub struct Prefetch {
    nodes: usize,
}

impl Pass for Prefetch {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let starts: Vec<usize> = (0..g.nodes.len())
            .filter(|&i| matches!(g.nodes[i].op, Op::CollectiveStart { .. }))
            .collect();
        if starts.is_empty() {
            report.decline(
                None,
                "",
                if g.mesh.is_none() {
                    "the graph has no mesh, so no collective to start earlier"
                } else {
                    "the graph has no collective to start earlier"
                },
            );
            return Ok((g.clone(), report));
        }
        let moves = Moves::of(g);
        // Each node's place in the new order: (the original index it goes before, 0 for a
        // moved start so that it comes first there, 1 otherwise), then its original index.
        let mut keys: Vec<(usize, u8, usize)> = (0..g.nodes.len()).map(|i| (i, 1, i)).collect();
        let mut moved = 0usize;
        let mut distance = 0usize;
        for &i in &starts {
            let (earliest, prep) = moves.earliest(g, i);
            let target = i.saturating_sub(self.nodes).max(earliest);
            if target < i {
                place(&mut keys, i, target, &prep);
                moved += 1;
                distance += i - target;
            }
        }
        if moved == 0 {
            report.decline(
                None,
                "",
                "every collective already starts right after its operand is produced",
            );
            return Ok((g.clone(), report));
        }
        let out = reordered(g, &keys);
        report.change(format!(
            "started {moved} of {} collectives earlier, by {:.1} nodes on average",
            starts.len(),
            distance as f64 / moved as f64
        ));
        report.metric("prefetch.moved", moved as f64);
        report.metric("prefetch.nodes", self.nodes as f64);
        Ok((out.canonical(), report))
    }
}

/// What moving a collective start earlier may not cross, computed once per graph.
pub(crate) struct Moves {
    producers: Vec<Option<usize>>,
    users: Vec<Vec<usize>>,
    /// Where each node's phase begins: a start stays in its own phase (the verifier keeps
    /// phases in order, and activation checkpointing reads them).
    phase_start: Vec<usize>,
}

impl Moves {
    pub(crate) fn of(g: &Graph) -> Moves {
        let mut phase_start = vec![0; g.nodes.len()];
        for i in 1..g.nodes.len() {
            phase_start[i] = if g.nodes[i].meta.phase == g.nodes[i - 1].meta.phase {
                phase_start[i - 1]
            } else {
                i
            };
        }
        Moves {
            producers: g.producers(),
            users: g.users(),
            phase_start,
        }
    }

    /// The earliest place start `i` may go, and the layout nodes that go with it.
    pub(crate) fn earliest(&self, g: &Graph, i: usize) -> (usize, Vec<usize>) {
        let prep = operand_layout(g, &self.producers, &self.users, i);
        // The earliest place every value the start and its layout nodes read exists.
        let earliest = prep
            .iter()
            .chain([&i])
            .flat_map(|&n| &g.nodes[n].inputs)
            .filter_map(|v| self.producers[v.index()])
            .filter(|p| !prep.contains(p))
            .map(|p| p + 1)
            .max()
            .unwrap_or(0)
            .max(self.phase_start[i]);
        (earliest, prep)
    }
}

/// Puts start `i` and the layout nodes `prep` preparing its operand right before node
/// `target`, in `keys` (see `Prefetch::run`).
pub(crate) fn place(keys: &mut [(usize, u8, usize)], i: usize, target: usize, prep: &[usize]) {
    for &n in prep.iter().filter(|&&n| n >= target) {
        keys[n] = (target, 0, n);
    }
    keys[i] = (target, 0, i);
}

/// `g` with its nodes in the order `keys` sorts them into.
pub(crate) fn reordered(g: &Graph, keys: &[(usize, u8, usize)]) -> Graph {
    let mut order: Vec<usize> = (0..g.nodes.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    let mut out = g.clone();
    out.nodes = order.iter().map(|&i| g.nodes[i].clone()).collect();
    out
}

/// The layout nodes (reshape, transpose, slice, concat) that only prepare start `i`'s operand,
/// such as the flattening and concatenation of a bucket: they move up with the start.
fn operand_layout(
    g: &Graph,
    producers: &[Option<usize>],
    users: &[Vec<usize>],
    i: usize,
) -> Vec<usize> {
    let mut prep = Vec::new();
    let mut readers = vec![i];
    let mut stack = vec![g.nodes[i].inputs[0]];
    while let Some(v) = stack.pop() {
        let Some(p) = producers[v.index()] else {
            continue;
        };
        let layout = matches!(
            g.nodes[p].op,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Concat { .. }
        );
        let only_for_this = users[v.index()].iter().all(|u| readers.contains(u));
        let is_output = g.outputs.iter().any(|o| o.value == v);
        if layout && only_for_this && !is_output && !prep.contains(&p) {
            prep.push(p);
            readers.push(p);
            stack.extend(g.nodes[p].inputs.iter().copied());
        }
    }
    prep.sort_unstable();
    prep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// Two gathered weights: each start moves up, the second not above the node producing
    /// its operand, and both waits stay before their matmuls. Checked on both ranks.
    #[test]
    fn starts_move_up_to_their_operand() {
        let out = check(
            &Prefetch { nodes: 4 },
            "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %v: f32[2,4] @ [shard(0)]
  %3: f32[2,4] = exp(%x)  # fwd a
  %4: f32[2,4] = neg(%3)  # fwd a
  %5: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd b
  %6: f32[4,4] = wait(%5)  # fwd b
  %7: f32[2,4] = matmul(%4, %6)  # fwd b
  %8: f32[2,4] = mul_scalar(%v, value=2)  # fwd c
  %9: f32[2,4] = exp(%7)  # fwd c
  %10: f32[4,4] = all_gather_start(%8, mesh_dims=[0], group=2, axis=0)  # fwd c
  %11: f32[4,4] = wait(%10)  # fwd c
  %12: f32[2,4] = matmul(%9, %11)  # fwd c
  output y = %12 @ [shard(0)]
}",
        );
        insta::assert_snapshot!(out);
    }
    /// A bucket's start moves up with the layout nodes that flatten and join its operands.
    #[test]
    fn a_buckets_operand_layout_moves_with_its_start() {
        let out = check(
            &Prefetch { nodes: 8 },
            "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %n: f32[2] @ [shard(0)]
  %3: f32[2,4] = exp(%x)  # fwd a
  %4: f32[2,4] = neg(%3)  # fwd a
  %5: f32[1,2,4] = reshape(%w, shape=[1,2,4])  # fwd layers.0.w
  %6: f32[1,8] = reshape(%5, shape=[1,8])  # fwd layers.0.w
  %7: f32[1,2] = reshape(%n, shape=[1,2])  # fwd layers.0.n
  %8: f32[1,10] = concat(%6, %7, axis=1)  # fwd layers.0.w
  %9: f32[2,10] = all_gather_start(%8, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %10: f32[2,10] = wait(%9)  # fwd layers.0.w
  %11: f32[2,8] = slice(%10, axis=1, start=0, end=8)  # fwd layers.0.w
  %12: f32[4,4] = reshape(%11, shape=[4,4])  # fwd layers.0.w
  %13: f32[2,4] = matmul(%4, %12)  # fwd layers.0.w
  %14: f32[2,2] = slice(%10, axis=1, start=8, end=10)  # fwd layers.0.n
  %15: f32[4] = reshape(%14, shape=[4])  # fwd layers.0.n
  %16: f32[2,4] = rms_norm(%13, %15, eps=1e-5)  # fwd layers.0.n
  output y = %16 @ [shard(0)]
}",
        );
        insta::assert_snapshot!(out);
    }
}
