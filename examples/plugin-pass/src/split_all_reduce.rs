//! `split-all-reduce`: an example pass that rewrites collectives. Every all-reduce becomes the
//! reduce-scatter and all-gather a ring all-reduce is made of, so that other passes can move
//! the two halves apart (the gather may start later than the scatter ends).
//!
//! Changes: `all_reduce_start(x)` and its `wait` become `reduce_scatter_start(x, axis=0)`, its
//! `wait`, and `all_gather_start(.., axis=0)` where the all-reduce started, and the gather's
//! `wait` where the all-reduce's wait was; later readers read that wait.
//! Guarantees: tier 1. The reduce-scatter adds each element over the ranks in rank order, as
//! the all-reduce did, and the gather moves bits; every rank runs the same graph, so all issue
//! the new collectives in the same order.
//! Declines: an all-reduce whose first axis does not split over its group, or whose operand is
//! split over another mesh dimension (its rows are then not the whole tensor's), naming it; a
//! graph without a mesh is returned unchanged.

use graphtrain::ir::graph::Node;
use graphtrain::ir::{spmd, Collective, Graph, Op, Placement, ValueId};
use graphtrain_passes::{Pass, PassError, PassInfo, PassReport, Registry, Tier};

pub const INFO: PassInfo = PassInfo {
    name: "split-all-reduce",
    tier: Tier::Preserving,
    summary: "rewrite each all-reduce as a reduce-scatter then an all-gather (example plugin)",
    contract: "Every all-reduce becomes a reduce-scatter along axis 0, waited for where the \
all-reduce started, then an all-gather waited for where the all-reduce's wait was. Tier 1: each \
element is still summed over the ranks in rank order. Declines an all-reduce whose first axis \
does not split over its group or whose operand is split over another mesh dimension.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(SplitAllReduce)));
}

pub struct SplitAllReduce;

impl Pass for SplitAllReduce {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let Some(mesh) = &g.mesh else {
            return Ok((g.clone(), report));
        };
        let error = |message: String| PassError {
            pass: INFO.name.to_string(),
            message,
        };
        let placements = spmd::propagate(g, mesh)
            .map_err(|(node, why)| error(format!("node {node}: {why}")))?
            .placements;
        let users = g.users();
        // The all-reduces to split: start node -> its wait node.
        let mut wait_of = vec![None; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            let Op::CollectiveStart {
                collective: Collective::AllReduce { .. },
                mesh_dims,
                group,
            } = &n.op
            else {
                continue;
            };
            let Some(&wait) = users[n.outputs[0].index()].first() else {
                continue;
            };
            let x = g.ty(n.inputs[0]);
            let split_elsewhere = placements[n.inputs[0].index()].as_ref().is_none_or(|p| {
                p.0.iter()
                    .enumerate()
                    .any(|(d, q)| !mesh_dims.contains(&d) && matches!(q, Placement::Shard(_)))
            });
            if x.rank() == 0 || !x.shape[0].is_multiple_of(*group) {
                report.decline(
                    Some(i),
                    n.meta.module.clone(),
                    format!("its first axis does not split over the {group} ranks"),
                );
            } else if split_elsewhere {
                report.decline(
                    Some(i),
                    n.meta.module.clone(),
                    "its operand is split over another mesh dimension",
                );
            } else {
                wait_of[i] = Some(wait);
            }
        }
        let count = wait_of.iter().flatten().count();
        if count == 0 {
            return Ok((g.clone(), report));
        }
        let mut out = Graph {
            nodes: Vec::new(),
            ..g.clone()
        };
        let mut map: Vec<ValueId> = (0..g.values.len() as u32).map(ValueId).collect();
        // For each split all-reduce's wait: the gather's handle it waits for instead.
        let mut gather_of = vec![None; g.nodes.len()];
        let type_error = |e: graphtrain::ir::TypeError| error(e.to_string());
        for (i, n) in g.nodes.iter().enumerate() {
            if let (
                Some(wait),
                Op::CollectiveStart {
                    collective: Collective::AllReduce { reduce },
                    mesh_dims,
                    group,
                },
            ) = (wait_of[i], &n.op)
            {
                let scatter = Op::CollectiveStart {
                    collective: Collective::ReduceScatter {
                        axis: 0,
                        reduce: *reduce,
                    },
                    mesh_dims: mesh_dims.clone(),
                    group: *group,
                };
                let gather = Op::CollectiveStart {
                    collective: Collective::AllGather { axis: 0 },
                    mesh_dims: mesh_dims.clone(),
                    group: *group,
                };
                let x = map[n.inputs[0].index()];
                let h = out
                    .push1(scatter, vec![x], n.meta.clone())
                    .map_err(type_error)?;
                let part = out
                    .push1(Op::Wait, vec![h], n.meta.clone())
                    .map_err(type_error)?;
                let h = out
                    .push1(gather, vec![part], n.meta.clone())
                    .map_err(type_error)?;
                gather_of[wait] = Some(h);
                continue;
            }
            if let Some(h) = gather_of[i] {
                let whole = out
                    .push1(Op::Wait, vec![h], n.meta.clone())
                    .map_err(type_error)?;
                map[n.outputs[0].index()] = whole;
                continue;
            }
            let inputs = n.inputs.iter().map(|v| map[v.index()]).collect();
            out.nodes.push(Node {
                inputs,
                ..n.clone()
            });
        }
        for o in &mut out.outputs {
            o.value = map[o.value.index()];
        }
        report.change(format!(
            "split {count} all-reduce(s) into a reduce-scatter and an all-gather"
        ));
        Ok((out.canonical(), report))
    }
}
