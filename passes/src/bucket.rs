//! `bucket`: one collective per transformer block and kind, where there were one per tensor
//! (torchtitan's FSDP bucketing). Each collective costs a fixed price on top of its bytes (the
//! members meeting, a network's latency), and a block has nine weights.
//!
//! Changes: the all-gathers along axis 0 (FSDP's parameter gathers), the reduce-scatters along
//! axis 0 (FSDP's gradient scatters) and the all-reduces (DDP's and tensor parallelism's
//! gradient sums) of one transformer block (`meta.layer`; outside blocks, one module, such as
//! DDP's gradient sums at the end of backward), one phase and one group become one collective:
//! each operand flattened as one block per rank, the blocks concatenated, one collective, and
//! each result sliced back out. The bucket starts where its last operand is ready (the first
//! member's start for parameters; the last gradient's producer for gradients), and its wait is
//! emitted before the first node that reads any member's result.
//! Guarantees: tier 1. Gathers and slices move bits; a reduction still adds each element over
//! the ranks in rank order; every rank runs the same graph, so every rank issues the same
//! buckets in the same order. A bucket holds all its members' results from its wait to the last
//! member's reader: gathered weights of a block arrive together.
//! Declines: without a mesh; a collective alone of its kind in its block or module (the
//! embedding's and the output head's stay alone, rather than one being gathered a whole forward
//! early); operands split over mesh dimensions other than the collective's (flattening a
//! tensor-parallel shard would break it); and a group where a member's result is read before
//! the bucket could start.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::rebuild::Rebuild;
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::graph::{Meta, Phase};
use graphtrain_ir::{spmd, Collective, DType, Graph, Op, Placement, Reduce, ValueId};

pub const INFO: PassInfo = PassInfo {
    name: "bucket",
    tier: Tier::Preserving,
    summary:
        "one all-gather, reduce-scatter or all-reduce per transformer block (or module) and kind",
    contract: "Merges the all-gathers along axis 0, the reduce-scatters along axis 0 and the \
all-reduces of one transformer block (outside blocks, one module), phase and group into one \
collective each: operands \
flattened and concatenated as one block per rank, one collective, results sliced back out. The \
bucket starts where its last operand is ready and is waited for before the first reader of any \
member. Tier 1: bits are moved, reductions add over ranks in rank order. Declines without a \
mesh, for a collective alone of its kind in its block or module, for operands split over other \
mesh dimensions, and where a member's result is read before the bucket could start.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(Bucket)));
}

pub struct Bucket;

/// What a bucket does, which decides how operands are flattened and results cut back out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gather,
    Scatter(Reduce),
    Sum(Reduce),
}

/// Collectives that may share a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Key {
    /// The micro-batch and phase (`Meta::stage`): a bucket never spans two.
    stage: (u32, Phase),
    /// `layers.N` for a transformer block's collectives, else the module's path.
    block: String,
    kind: Kind,
    mesh_dims: Vec<usize>,
    group: usize,
    dtype: DType,
}

struct Member {
    start: usize,
    wait: usize,
}

struct Plan {
    kind: Kind,
    members: Vec<Member>,
    /// The input-graph node before which the bucket starts.
    at: usize,
}

impl Pass for Bucket {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let Some(mesh) = &g.mesh else {
            report.decline(
                None,
                "",
                "the graph has no mesh, so no collective to bucket",
            );
            return Ok((g.clone(), report));
        };
        let placements = spmd::propagate(g, mesh)
            .map_err(|(node, why)| PassError {
                pass: INFO.name.into(),
                message: format!("placements do not propagate at node {node}: {why}"),
            })?
            .placements;
        let users = g.users();
        let producers = g.producers();
        // In order of their first member, so buckets start in the order their collectives did.
        let mut groups: Vec<(Key, Vec<Member>)> = Vec::new();
        for (i, node) in g.nodes.iter().enumerate() {
            let Op::CollectiveStart {
                collective,
                mesh_dims,
                group,
            } = &node.op
            else {
                continue;
            };
            let kind = match *collective {
                Collective::AllGather { axis: 0 } => Kind::Gather,
                Collective::ReduceScatter { axis: 0, reduce } => Kind::Scatter(reduce),
                Collective::AllReduce { reduce } => Kind::Sum(reduce),
                _ => continue,
            };
            let wait = match users[node.outputs[0].index()].as_slice() {
                [w] if matches!(g.nodes[*w].op, Op::Wait) => *w,
                _ => continue,
            };
            let block = match node.meta.layer {
                Some(layer) => format!("layers.{layer}"),
                None => node.meta.module.clone(),
            };
            let operand = node.inputs[0];
            // An all-reduce's operand may be split by rows over another dimension (HSDP's
            // gradient shards): flattened as one row, the split stays one block per rank.
            let split_elsewhere = placements[operand.index()].as_ref().is_none_or(|p| {
                p.0.iter().enumerate().any(|(d, q)| {
                    !mesh_dims.contains(&d)
                        && match (kind, q) {
                            (Kind::Sum(_), Placement::Shard(0)) => false,
                            (_, q) => matches!(q, Placement::Shard(_)),
                        }
                })
            });
            if split_elsewhere {
                report.decline(
                    Some(i),
                    node.meta.module.clone(),
                    "its operand is split over another mesh dimension too (flattening would \
break that split)",
                );
                continue;
            }
            let key = Key {
                stage: node.meta.stage(),
                block,
                kind,
                mesh_dims: mesh_dims.clone(),
                group: *group,
                dtype: g.ty(operand).dtype,
            };
            let member = Member { start: i, wait };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(member),
                None => groups.push((key, vec![member])),
            }
        }
        // Where each group's bucket can start, and whether every member's result is read after.
        let first_reader = |wait: usize| -> usize {
            let out = g.nodes[wait].outputs[0];
            let read = users[out.index()].first().copied().unwrap_or(g.nodes.len());
            if g.outputs.iter().any(|o| o.value == out) {
                read.min(g.nodes.len())
            } else {
                read
            }
        };
        let mut plans = Vec::new();
        let mut alone = 0;
        for (key, members) in groups {
            if members.len() < 2 {
                alone += 1;
                continue;
            }
            let ready = members
                .iter()
                .map(|m| producers[g.nodes[m.start].inputs[0].index()].map_or(0, |p| p + 1))
                .max()
                .unwrap_or(0);
            let at = ready.max(members[0].start);
            let read = members.iter().map(|m| first_reader(m.wait)).min().unwrap();
            if read < at {
                report.decline(
                    Some(members[0].start),
                    g.nodes[members[0].start].meta.module.clone(),
                    format!(
                        "`{}`: a member's result is read (node {read}) before the last operand \
is ready (node {at})",
                        key.block
                    ),
                );
                continue;
            }
            plans.push(Plan {
                kind: key.kind,
                members,
                at,
            });
        }
        if alone > 0 {
            report.decline(
                None,
                "",
                format!(
                    "{alone} collectives are the only one of their kind in their block or module"
                ),
            );
        }
        if plans.is_empty() {
            if report.declined.is_empty() {
                report.decline(
                    None,
                    "",
                    "no transformer block has two collectives of one kind to bucket",
                );
            }
            return Ok((g.clone(), report));
        }
        let before: usize = plans.iter().map(|p| p.members.len()).sum();
        let count = |kind: fn(&Kind) -> bool| -> (usize, usize) {
            plans
                .iter()
                .filter(|p| kind(&p.kind))
                .fold((0, 0), |(m, b), p| (m + p.members.len(), b + 1))
        };
        let (gm, gb) = count(|k| matches!(k, Kind::Gather));
        let (sm, sb) = count(|k| matches!(k, Kind::Scatter(_)));
        let (am, ab) = count(|k| matches!(k, Kind::Sum(_)));
        let out = rewrite(g, &plans)?;
        report.change(format!(
            "bucketed {before} collectives into {} (per transformer block or module): \
all-gathers {gm} -> {gb}, reduce-scatters {sm} -> {sb}, all-reduces {am} -> {ab}",
            plans.len()
        ));
        report.metric("bucket.collectives_before", before as f64);
        report.metric("bucket.buckets", plans.len() as f64);
        Ok((out.canonical(), report))
    }
}

/// What a node of the input graph is to a bucket.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Keep,
    /// A member's start or wait: replaced by the bucket's.
    Skip,
}

fn rewrite(g: &Graph, plans: &[Plan]) -> Result<Graph, PassError> {
    let mut roles = vec![Role::Keep; g.nodes.len()];
    let mut starts_at: Vec<Vec<usize>> = vec![Vec::new(); g.nodes.len() + 1];
    // For each member's result: (bucket, member).
    let mut result_of: Vec<Option<(usize, usize)>> = vec![None; g.values.len()];
    for (b, plan) in plans.iter().enumerate() {
        starts_at[plan.at].push(b);
        for (k, m) in plan.members.iter().enumerate() {
            roles[m.start] = Role::Skip;
            roles[m.wait] = Role::Skip;
            result_of[g.nodes[m.wait].outputs[0].index()] = Some((b, k));
        }
    }
    let mut e = Emitter {
        r: Rebuild::of(g, INFO.name),
        handle: vec![None; plans.len()],
        arrived: vec![None; plans.len()],
    };
    for (i, node) in g.nodes.iter().enumerate() {
        e.r.enter(&node.meta);
        for &b in &starts_at[i] {
            // An operand that is another bucket's member result (HSDP: a reduce-scatter's
            // result then all-reduced) is cut out of that bucket first.
            for m in &plans[b].members {
                if let Some((b2, k2)) = result_of[g.nodes[m.start].inputs[0].index()] {
                    e.member_result(g, &plans[b2], b2, k2)?;
                }
            }
            e.start(g, &plans[b], b)?;
        }
        if roles[i] == Role::Skip {
            continue;
        }
        for v in &node.inputs {
            if let Some((b, k)) = result_of[v.index()] {
                e.member_result(g, &plans[b], b, k)?;
            }
        }
        e.r.keep(node);
    }
    for o in &g.outputs {
        if let Some((b, k)) = result_of[o.value.index()] {
            e.member_result(g, &plans[b], b, k)?;
        }
    }
    Ok(e.r.finish())
}

struct Emitter {
    r: Rebuild,
    /// Per bucket, its collective's handle once started.
    handle: Vec<Option<ValueId>>,
    /// Per bucket, its result once waited for.
    arrived: Vec<Option<ValueId>>,
}

impl Emitter {
    fn reshape(
        &mut self,
        v: ValueId,
        shape: Vec<usize>,
        meta: &Meta,
    ) -> Result<ValueId, PassError> {
        if self.r.out.ty(v).shape == shape {
            return Ok(v);
        }
        self.r.add(Op::Reshape { shape }, vec![v], meta)
    }

    /// The operands flattened as one block per rank and concatenated, and the one collective.
    fn start(&mut self, g: &Graph, plan: &Plan, b: usize) -> Result<(), PassError> {
        let first = &g.nodes[plan.members[0].start];
        let (mesh_dims, group) = match &first.op {
            Op::CollectiveStart {
                mesh_dims, group, ..
            } => (mesh_dims.clone(), *group),
            _ => unreachable!("a member is a collective start"),
        };
        let mut flats = Vec::with_capacity(plan.members.len());
        for m in &plan.members {
            let node = &g.nodes[m.start];
            let operand = self.r.map[node.inputs[0].index()];
            let shape = g.ty(node.inputs[0]).shape.clone();
            let numel: usize = shape.iter().product();
            let flat = match plan.kind {
                // A rank's shard as one row: (rank, rows, ...) first, then (rank, elements),
                // so that each step keeps it one block per rank.
                Kind::Gather => {
                    let by_rank = [vec![1], shape.clone()].concat();
                    let v = self.reshape(operand, by_rank, &node.meta)?;
                    self.reshape(v, vec![1, numel], &node.meta)?
                }
                // The rows rank r gets back, as row r.
                Kind::Scatter(_) => {
                    self.reshape(operand, vec![group, numel / group], &node.meta)?
                }
                Kind::Sum(_) => {
                    let by_rank = [vec![1], shape.clone()].concat();
                    let v = self.reshape(operand, by_rank, &node.meta)?;
                    self.reshape(v, vec![1, numel], &node.meta)?
                }
            };
            flats.push(flat);
        }
        let joined = self.r.add(Op::Concat { axis: 1 }, flats, &first.meta)?;
        let collective = match plan.kind {
            Kind::Gather => Collective::AllGather { axis: 0 },
            Kind::Scatter(reduce) => Collective::ReduceScatter { axis: 0, reduce },
            Kind::Sum(reduce) => Collective::AllReduce { reduce },
        };
        let op = Op::CollectiveStart {
            collective,
            mesh_dims,
            group,
        };
        self.handle[b] = Some(self.r.add(op, vec![joined], &first.meta)?);
        Ok(())
    }

    /// Member `k`'s result, cut out of the bucket's (waiting for the bucket first).
    fn member_result(
        &mut self,
        g: &Graph,
        plan: &Plan,
        b: usize,
        k: usize,
    ) -> Result<(), PassError> {
        let wait = &g.nodes[plan.members[k].wait];
        let result = wait.outputs[0];
        if self.r.map[result.index()] != result {
            return Ok(());
        }
        let arrived = match self.arrived[b] {
            Some(v) => v,
            None => {
                let handle = self.handle[b].expect("a bucket starts before its readers");
                let v = self.r.add(Op::Wait, vec![handle], &wait.meta)?;
                self.arrived[b] = Some(v);
                v
            }
        };
        // Where member k's elements sit in each rank's block of the bucket.
        let group = match g.nodes[plan.members[0].start].op {
            Op::CollectiveStart { group, .. } => group,
            _ => unreachable!("a member is a collective start"),
        };
        let per_row: Vec<usize> = plan
            .members
            .iter()
            .map(|m| {
                let numel = g.ty(g.nodes[m.wait].outputs[0]).numel();
                match plan.kind {
                    Kind::Gather => numel / group,
                    Kind::Scatter(_) | Kind::Sum(_) => numel,
                }
            })
            .collect();
        let shape = g.ty(result).shape.clone();
        let offset: usize = per_row[..k].iter().sum();
        let piece = self.r.add(
            Op::Slice {
                axis: 1,
                start: offset,
                end: offset + per_row[k],
            },
            vec![arrived],
            &wait.meta,
        )?;
        let value = match plan.kind {
            Kind::Scatter(_) | Kind::Sum(_) => {
                let by_rank = [vec![1], shape.clone()].concat();
                let v = self.reshape(piece, by_rank, &wait.meta)?;
                self.reshape(v, shape, &wait.meta)?
            }
            Kind::Gather => self.reshape(piece, shape, &wait.meta)?,
        };
        self.r.map[result.index()] = value;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// One FSDP block: two weights gathered in forward (one a vector) and their gradients
    /// reduce-scattered in backward, each pair becoming one collective; checked bitwise on both
    /// ranks.
    const FSDP_BLOCK: &str = "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %n: f32[2] @ [shard(0)]
  %3: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %4: f32[4] = all_gather_start(%n, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.n
  %5: f32[4,4] = wait(%3)  # fwd layers.0.w
  %6: f32[2,4] = matmul(%x, %5)  # fwd layers.0.w
  %7: f32[4] = wait(%4)  # fwd layers.0.n
  %8: f32[2,4] = rms_norm(%6, %7, eps=1e-5)  # fwd layers.0.n
  %9: f32[4,2] = transpose(%x, perm=[1,0])  # bwd layers.0.w
  %10: f32[4,4] = matmul(%9, %8)  # bwd layers.0.w
  %11: f32[2,4] = reduce_scatter_start(%10, mesh_dims=[0], group=2, axis=0, reduce=sum)  # bwd layers.0.w
  %12: f32[2,4] = wait(%11)  # bwd layers.0.w
  %13: f32[4] = reduce_sum(%8, axes=[0], keepdim=false)  # bwd layers.0.n
  %14: f32[2] = reduce_scatter_start(%13, mesh_dims=[0], group=2, axis=0, reduce=sum)  # bwd layers.0.n
  %15: f32[2] = wait(%14)  # bwd layers.0.n
  output y = %8 @ [shard(0)]
  output gw = %12 @ [shard(0)]
  output gn = %15 @ [shard(0)]
}";

    #[test]
    fn a_blocks_gathers_and_scatters_become_one_each() {
        insta::assert_snapshot!(check(&Bucket, FSDP_BLOCK));
    }

    /// DDP over dp_replicate: the gradients' all-reduces of one block become one.
    #[test]
    fn a_blocks_all_reduces_become_one() {
        let out = check(
            &Bucket,
            "graph g {
  mesh dp_replicate=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[4,4] @ [replicate]
  %2: f32[2,4] = matmul(%x, %w)  # fwd layers.1.w
  %3: f32[4,2] = transpose(%x, perm=[1,0])  # bwd layers.1.w
  %4: f32[4,4] = matmul(%3, %2)  # bwd layers.1.w
  %5: f32[4,4] = all_reduce_start(%4, mesh_dims=[0], group=2, reduce=sum)  # bwd layers.1.w
  %6: f32[4,4] = wait(%5)  # bwd layers.1.w
  %7: f32[4] = reduce_sum(%2, axes=[0], keepdim=false)  # bwd layers.1.b
  %8: f32[4] = all_reduce_start(%7, mesh_dims=[0], group=2, reduce=sum)  # bwd layers.1.b
  %9: f32[4] = wait(%8)  # bwd layers.1.b
  output y = %2 @ [shard(0)]
  output gw = %6 @ [replicate]
  output gb = %9 @ [replicate]
}",
        );
        assert!(out.contains("all-reduces 2 -> 1"), "{out}");
        assert_eq!(out.matches("all_reduce_start").count(), 1, "{out}");
    }

    #[test]
    fn outside_blocks_and_without_a_mesh_it_says_so() {
        // Outside blocks, each module's collectives are their own bucket: alone, they stay.
        let out = check(&Bucket, &FSDP_BLOCK.replace("layers.0.", "output."));
        assert!(out.contains("// no change"), "{out}");
        assert!(
            out.contains("4 collectives are the only one of their kind"),
            "{out}"
        );
        let out = check(
            &Bucket,
            "graph g {
  input %x: f32[2,4]
  %1: f32[2,4] = exp(%x)  # fwd a
  output y = %1
}",
        );
        assert!(out.contains("the graph has no mesh"), "{out}");
    }
}
