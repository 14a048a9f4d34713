//! `remat`: rematerialization, the acting half of activation checkpointing.
//!
//! Changes: for every forward/loss value whose producer is tagged `remat=recompute` and that a
//! backward or optimizer node reads, emits a copy of the producing node (and, recursively, of the
//! recompute-tagged producers that copy needs) right before the first backward reader, with phase
//! `bwd`, the original module path and `remat=recompute`. Backward readers then read the copy, so
//! the forward value's lifetime ends in the forward pass. Each value is recomputed once; its copy
//! serves every backward reader. What a copy reads that is not itself recomputed (a value tagged
//! `save`, `offload` or untagged, or a graph input) becomes a saved activation.
//!
//! Guarantees: tier 1. Ops are pure and deterministic (random ops are keyed by a seed input), so a
//! copy computes bitwise the value the original computed. Forward nodes are untouched, phases stay
//! monotone, and running the pass twice changes nothing the second time.
//!
//! Declines (the value stays saved) when a recompute-tagged value is a graph output: it is live to
//! the end anyway, so recomputing it would only add work. Tags on backward/optimizer nodes are
//! ignored: only forward values are saved across the phase boundary.
//!
//! A recompute copy whose first reader is an optimizer node is placed at the end of the backward
//! phase instead, so that phases stay monotone.

use crate::memory::{human_bytes, profile};
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::stats::node_flops;
use graphtrain_ir::{Graph, Node, Phase, Remat, ValueId};
use std::collections::HashMap;

pub const INFO: PassInfo = PassInfo {
    name: "remat",
    tier: Tier::Preserving,
    summary: "recompute remat=recompute forward values in backward instead of saving them",
    contract:
        "For every forward value tagged remat=recompute that backward reads, emits a copy of \
its producer (and recursively of the recompute-tagged producers it needs) right before the first \
backward reader, phase bwd, same module, remat=recompute; backward readers read the copy, so the \
forward value dies in forward. Each value is recomputed once. Tier 1: ops are pure and \
deterministic, results are bitwise unchanged. Declines for recompute-tagged graph outputs (live \
to the end anyway). Idempotent.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(RematPass)));
}

/// What rematerialization would do for a given choice of recompute-tagged nodes: computed without
/// rewriting, so a policy can try many choices cheaply.
#[derive(Clone, Debug, PartialEq)]
pub struct RematPlan {
    /// Per node: a copy of it will be emitted in backward.
    pub recompute: Vec<bool>,
    /// Per value: a forward value that stays alive into backward (read by a backward node or by a
    /// recompute copy, and not itself recomputed).
    pub saved: Vec<bool>,
    pub saved_bytes: usize,
    /// FLOPs of the copies (`graphtrain_ir::stats::node_flops`).
    pub recompute_flops: f64,
    /// Recompute-tagged nodes that backward reads but that stay saved because one of their
    /// outputs is a graph output.
    pub kept_outputs: Vec<usize>,
}

/// Plans rematerialization of `g` where `tagged(i)` says node `i` is tagged `recompute`.
/// Only forward/loss nodes can be recomputed; see the module docs for the rules.
pub fn plan(g: &Graph, tagged: impl Fn(usize) -> bool) -> RematPlan {
    let producers = g.producers();
    let mut is_output = vec![false; g.values.len()];
    for o in &g.outputs {
        is_output[o.value.index()] = true;
    }
    let mut read_in_bwd = vec![false; g.values.len()];
    for n in g.nodes.iter().filter(|n| n.meta.phase >= Phase::Backward) {
        for v in &n.inputs {
            read_in_bwd[v.index()] = true;
        }
    }
    let mut kept_outputs = Vec::new();
    let recomputable: Vec<bool> = g
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if n.meta.phase > Phase::Loss || !tagged(i) {
                return false;
            }
            if n.outputs.iter().any(|o| is_output[o.index()]) {
                if n.outputs.iter().any(|o| read_in_bwd[o.index()]) {
                    kept_outputs.push(i);
                }
                return false;
            }
            true
        })
        .collect();

    // Mark what backward needs, following recompute-tagged producers transitively.
    let mut recompute = vec![false; g.nodes.len()];
    let mut stack: Vec<usize> = Vec::new();
    for n in g.nodes.iter().filter(|n| n.meta.phase >= Phase::Backward) {
        for v in &n.inputs {
            if let Some(p) = producers[v.index()] {
                if recomputable[p] {
                    stack.push(p);
                }
            }
        }
    }
    while let Some(p) = stack.pop() {
        if std::mem::replace(&mut recompute[p], true) {
            continue;
        }
        for v in &g.nodes[p].inputs {
            if let Some(q) = producers[v.index()] {
                if recomputable[q] && !recompute[q] {
                    stack.push(q);
                }
            }
        }
    }

    let mut saved = vec![false; g.values.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if n.meta.phase < Phase::Backward && !recompute[i] {
            continue;
        }
        for v in &n.inputs {
            if let Some(p) = producers[v.index()] {
                if g.nodes[p].meta.phase <= Phase::Loss && !recompute[p] {
                    saved[v.index()] = true;
                }
            }
        }
    }
    let saved_bytes = saved
        .iter()
        .enumerate()
        .filter(|(_, s)| **s)
        .map(|(v, _)| g.values[v].size_bytes())
        .sum();
    let recompute_flops = g
        .nodes
        .iter()
        .zip(&recompute)
        .filter(|(_, r)| **r)
        .map(|(n, _)| node_flops(g, n))
        .sum();
    RematPlan {
        recompute,
        saved,
        saved_bytes,
        recompute_flops,
        kept_outputs,
    }
}

/// The plan for the `remat` tags already on `g`.
pub fn plan_from_tags(g: &Graph) -> RematPlan {
    plan(g, |i| g.nodes[i].meta.tags.remat == Some(Remat::Recompute))
}

/// Emits the copies `plan` calls for. Returns the rewritten graph (canonically numbered) and the
/// number of copies.
pub fn apply(g: &Graph, plan: &RematPlan) -> (Graph, usize) {
    let producers = g.producers();
    let mut out = g.clone();
    let mut copy_of: HashMap<ValueId, ValueId> = HashMap::new();
    let mut nodes: Vec<Node> = Vec::with_capacity(g.nodes.len() * 2);
    let first_opt = g
        .nodes
        .iter()
        .position(|n| n.meta.phase == Phase::Optimizer);

    for (i, n) in g.nodes.iter().enumerate() {
        if Some(i) == first_opt {
            // Copies must stay in backward: whatever optimizer nodes need comes first.
            let opt_reads: Vec<ValueId> = g.nodes[i..]
                .iter()
                .flat_map(|m| m.inputs.iter().copied())
                .collect();
            emit_copies(
                g,
                plan,
                &producers,
                &opt_reads,
                &mut copy_of,
                &mut nodes,
                &mut out,
            );
        }
        let mut n = n.clone();
        if n.meta.phase >= Phase::Backward {
            emit_copies(
                g,
                plan,
                &producers,
                &n.inputs,
                &mut copy_of,
                &mut nodes,
                &mut out,
            );
            for v in &mut n.inputs {
                *v = copy_of.get(v).copied().unwrap_or(*v);
            }
        }
        nodes.push(n);
    }
    let copies = nodes.len() - g.nodes.len();
    out.nodes = nodes;
    (out.canonical(), copies)
}

/// Appends to `nodes`, in dependency order, the copies needed so that `roots` can be read in
/// backward; `copy_of` maps every value already recomputed to its copy.
fn emit_copies(
    g: &Graph,
    plan: &RematPlan,
    producers: &[Option<usize>],
    roots: &[ValueId],
    copy_of: &mut HashMap<ValueId, ValueId>,
    nodes: &mut Vec<Node>,
    out: &mut Graph,
) {
    // Iterative post-order walk: a chain of recomputed nodes can be as long as a whole layer.
    let mut stack: Vec<(usize, bool)> = roots
        .iter()
        .rev()
        .filter_map(|v| producers[v.index()])
        .map(|p| (p, false))
        .collect();
    while let Some((p, inputs_done)) = stack.pop() {
        let orig = &g.nodes[p];
        if !plan.recompute[p] || copy_of.contains_key(&orig.outputs[0]) {
            continue;
        }
        if !inputs_done {
            stack.push((p, true));
            for v in orig.inputs.iter().rev() {
                if let Some(q) = producers[v.index()] {
                    stack.push((q, false));
                }
            }
            continue;
        }
        let mut copy = orig.clone();
        for v in &mut copy.inputs {
            *v = copy_of.get(v).copied().unwrap_or(*v);
        }
        copy.outputs = orig
            .outputs
            .iter()
            .map(|o| {
                let id = ValueId(out.values.len() as u32);
                out.values.push(g.ty(*o).clone());
                copy_of.insert(*o, id);
                id
            })
            .collect();
        copy.meta.phase = Phase::Backward;
        copy.meta.tags.remat = Some(Remat::Recompute);
        nodes.push(copy);
    }
}

pub struct RematPass;

impl Pass for RematPass {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let plan = plan_from_tags(g);
        let mut report = PassReport::default();
        let (out, copies) = rematerialize(g, &plan, &mut report);
        if copies == 0 {
            return Ok((g.clone(), report));
        }
        Ok((out, report))
    }
}

/// Applies `plan` and fills `report` with the declines, the change line and the metrics shared
/// by `remat` and `ac`: saved activation bytes and predicted peak before/after, recompute FLOPs.
pub(crate) fn rematerialize(
    g: &Graph,
    plan: &RematPlan,
    report: &mut PassReport,
) -> (Graph, usize) {
    for &i in &plan.kept_outputs {
        let n = &g.nodes[i];
        report.decline(
            Some(i),
            n.meta.module.clone(),
            format!(
                "{} is tagged recompute but its result is a graph output, live to the end anyway",
                n.op.name()
            ),
        );
    }
    let (out, copies) = apply(g, plan);
    if copies == 0 {
        return (out, 0);
    }
    let before = profile(g);
    let after = profile(&out);
    report.change(format!(
        "recomputed {copies} node(s) in backward; saved activations {} -> {}",
        human_bytes(before.saved_activation_bytes),
        human_bytes(after.saved_activation_bytes)
    ));
    report.metric(
        "saved_activation_bytes_before",
        before.saved_activation_bytes as f64,
    );
    report.metric(
        "saved_activation_bytes_after",
        after.saved_activation_bytes as f64,
    );
    report.metric("recompute_flops", plan.recompute_flops);
    report.metric("peak_bytes_before", before.peak_bytes as f64);
    report.metric("peak_bytes_after", after.peak_bytes as f64);
    (out, copies)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    #[test]
    fn recomputes_a_chain_once_before_the_first_backward_reader() {
        // %2 and %3 are tagged recompute; %3 needs %2, which needs the saved %1. Both backward
        // readers of %3 share one copy.
        let out = check(
            &RematPass,
            "graph g {
  input %x: f32[4]
  param %w: f32[4]
  %2: f32[4] = mul(%x, %w)  # fwd layers.0.a remat=save
  %3: f32[4] = exp(%2)  # fwd layers.0.b remat=recompute
  %4: f32[4] = sin(%3)  # fwd layers.0.c remat=recompute
  %5: f32[] = reduce_sum(%4, axes=[0], keepdim=false)  # loss
  %6: f32[4] = neg(%x)  # bwd
  %7: f32[4] = mul(%6, %4)  # bwd layers.0.c
  %8: f32[4] = mul(%7, %4)  # bwd layers.0.c
  %9: f32[4] = mul(%8, %3)  # bwd layers.0.b
  output loss = %5
  output g = %9
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn graph_outputs_are_not_recomputed() {
        let out = check(
            &RematPass,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd a remat=recompute
  %2: f32[4] = neg(%1)  # bwd
  output y = %1
  output g = %2
}",
        );
        assert!(out.starts_with("// no change"), "{out}");
        assert!(out.contains("graph output"), "{out}");
    }

    #[test]
    fn optimizer_readers_get_their_copy_at_the_end_of_backward() {
        let out = check(
            &RematPass,
            "graph g {
  param %w: f32[4]
  input %lr: f32[]
  %2: f32[4] = exp(%w)  # fwd a remat=recompute
  %3: f32[] = reduce_sum(%2, axes=[0], keepdim=false)  # loss
  %4: f32[4] = neg(%w)  # bwd
  %5: f32[4] = add(%4, %2)  # opt
  %6: f32[4] = sgd(%w, %5, %lr, weight_decay=0.0)  # opt
  output loss = %3
  output w = %6 donates %w
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn running_twice_changes_nothing_more() {
        let src = "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd layers.0 remat=recompute
  %2: f32[] = reduce_sum(%1, axes=[0], keepdim=false)  # loss
  %3: f32[4] = mul(%1, %x)  # bwd
  output loss = %2
  output g = %3
}";
        let once = crate::testing::try_check(&RematPass, src).unwrap();
        let (_, report) = RematPass.run(&once.graph).unwrap();
        assert!(report.is_noop(), "{report}");
    }
}
