//! The verifier: the invariants every graph must satisfy, checked after construction, parsing and
//! every pass. It reports the first violation found, naming the node and its module path.
//!
//! Checked:
//! - every value is defined exactly once (graph input or node output), and every operand and
//!   output refers to a value defined earlier in the schedule (no use before definition);
//! - input and output names are unique;
//! - every node's operand count, output count and output types agree with the op's rules
//!   (`infer::infer_types`);
//! - stages never go backwards along the schedule: forward, loss, backward, and in a step split
//!   into micro-batches each micro-batch's forward, loss and backward before the next one's,
//!   then the optimizer once (`Meta::stage`);
//! - donation: an output may only donate a `param` or `state` input of the same type, each input
//!   is donated at most once, a donated input is not itself an output, and nothing reads a donated
//!   input after the node that writes its replacement (the buffer is overwritten in place);
//! - SPMD graphs (with a mesh; collectives and placements need one): every collective start is
//!   read by exactly one `wait`, its group is the size of its mesh dimensions, input and output
//!   placements fit the mesh (parameters and state are never partial), every op can take its
//!   operands' placements (`spmd::propagate`), and declared output placements are the computed
//!   ones.

use crate::graph::{Graph, InputKind, Phase, ValueId};
use crate::infer::infer_types;
use crate::mesh::Placement;
use crate::op::Op;
use crate::spmd::propagate;
use std::collections::HashSet;
use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub struct VerifyError {
    /// Index of the offending node in schedule order, when a node is at fault.
    pub node: Option<usize>,
    pub op: Option<&'static str>,
    pub module: String,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.node, self.op) {
            (Some(i), Some(op)) => {
                let module = if self.module.is_empty() {
                    "<root>"
                } else {
                    &self.module
                };
                write!(f, "node {i} ({op} in `{module}`): {}", self.message)
            }
            _ => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for VerifyError {}

fn graph_error(message: String) -> VerifyError {
    VerifyError {
        node: None,
        op: None,
        module: String::new(),
        message,
    }
}

/// Checks every invariant listed in the module docs.
pub fn verify(g: &Graph) -> Result<(), VerifyError> {
    let n_values = g.values.len();
    let in_range = |v: ValueId| v.index() < n_values;
    // defined_at[v] = None: not yet defined; Some(None): graph input; Some(Some(i)): node i.
    let mut defined_at: Vec<Option<Option<usize>>> = vec![None; n_values];

    let mut names = HashSet::new();
    for input in &g.inputs {
        if !names.insert(input.name.as_str()) {
            return Err(graph_error(format!(
                "input `{}` is declared twice",
                input.name
            )));
        }
        if !in_range(input.value) {
            return Err(graph_error(format!(
                "input `{}` refers to a missing value",
                input.name
            )));
        }
        if defined_at[input.value.index()].is_some() {
            return Err(graph_error(format!(
                "input `{}` reuses another input's value",
                input.name
            )));
        }
        defined_at[input.value.index()] = Some(None);
    }

    let mut last_stage = None;
    for (i, node) in g.nodes.iter().enumerate() {
        let err = |message: String| VerifyError {
            node: Some(i),
            op: Some(node.op.name()),
            module: node.meta.module.clone(),
            message,
        };
        for (k, v) in node.inputs.iter().enumerate() {
            if !in_range(*v) || defined_at[v.index()].is_none() {
                return Err(err(format!(
                    "operand {k} is used before it is defined (value {} has no earlier definition)",
                    v.0
                )));
            }
        }
        let operand_types: Vec<_> = node.inputs.iter().map(|v| g.ty(*v).clone()).collect();
        let expected = infer_types(&node.op, &operand_types).map_err(|m| {
            let shown: Vec<String> = operand_types.iter().map(|t| t.to_string()).collect();
            err(format!("operands ({}) are refused: {m}", shown.join(", ")))
        })?;
        if expected.len() != node.outputs.len() {
            return Err(err(format!(
                "has {} output(s), the op produces {}",
                node.outputs.len(),
                expected.len()
            )));
        }
        for (k, (v, want)) in node.outputs.iter().zip(&expected).enumerate() {
            if !in_range(*v) {
                return Err(err(format!("output {k} refers to a missing value")));
            }
            if defined_at[v.index()].is_some() {
                return Err(err(format!("output {k} (value {}) is defined twice", v.0)));
            }
            defined_at[v.index()] = Some(Some(i));
            let got = g.ty(*v);
            if got != want {
                return Err(err(format!(
                    "output {k} is declared {got} but the op produces {want}"
                )));
            }
        }
        let stage = node.meta.stage();
        if let Some(prev) = last_stage {
            if stage < prev {
                return Err(err(format!(
                    "{} comes after {}; phases must run forward, loss, backward, optimizer (micro-batch by micro-batch, the optimizer last)",
                    stage_name(stage),
                    stage_name(prev)
                )));
            }
        }
        last_stage = Some(stage);
    }

    verify_outputs(g, &defined_at)?;
    verify_spmd(g)
}

/// Collectives and placements: only with a mesh; every collective start read by exactly one
/// `wait` (and a `wait` reads only a start); groups that match the mesh; placements that fit
/// the mesh and the value; and placement propagation through every node (`spmd.rs`).
fn verify_spmd(g: &Graph) -> Result<(), VerifyError> {
    let node_error = |i: usize, message: String| {
        let n = &g.nodes[i];
        VerifyError {
            node: Some(i),
            op: Some(n.op.name()),
            module: n.meta.module.clone(),
            message,
        }
    };
    let Some(mesh) = &g.mesh else {
        if let Some(i) = g.nodes.iter().position(|n| {
            matches!(
                n.op,
                Op::CollectiveStart { .. } | Op::Wait | Op::ToPartial { .. }
            )
        }) {
            return Err(node_error(
                i,
                "a collective in a graph without a mesh".into(),
            ));
        }
        let placed = g
            .inputs
            .iter()
            .find(|i| i.placement.is_some())
            .map(|i| &i.name);
        let placed = placed.or(g
            .outputs
            .iter()
            .find(|o| o.placement.is_some())
            .map(|o| &o.name));
        if let Some(name) = placed {
            return Err(graph_error(format!(
                "`{name}` has a placement but the graph has no mesh"
            )));
        }
        return Ok(());
    };
    let producers = g.producers();
    let users = g.users();
    // For each donated input, the node whose output replaces it in place.
    let mut updated_in_place_at: Vec<Option<usize>> = vec![None; g.values.len()];
    for o in &g.outputs {
        if let (Some(input), Some(k)) = (o.donates, producers[o.value.index()]) {
            updated_in_place_at[input.index()] = Some(k);
        }
    }
    for (i, n) in g.nodes.iter().enumerate() {
        match &n.op {
            Op::CollectiveStart {
                mesh_dims, group, ..
            } => {
                if let Some(d) = mesh_dims.iter().find(|d| **d >= mesh.dims.len()) {
                    return Err(node_error(
                        i,
                        format!("mesh dimension {d} is not in the mesh {mesh}"),
                    ));
                }
                let mut sorted = mesh_dims.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != mesh_dims.len() {
                    return Err(node_error(
                        i,
                        format!("mesh dimensions {mesh_dims:?} repeat"),
                    ));
                }
                if *group != mesh.group_size(mesh_dims) {
                    return Err(node_error(
                        i,
                        format!(
                            "group {group} is not the size of mesh dimensions {mesh_dims:?} of {mesh} ({})",
                            mesh.group_size(mesh_dims)
                        ),
                    ));
                }
                let handle = n.outputs[0];
                let readers = &users[handle.index()];
                let waits = readers
                    .iter()
                    .filter(|&&u| g.nodes[u].op == Op::Wait)
                    .count();
                if readers.len() != 1 || waits != 1 {
                    return Err(node_error(
                        i,
                        format!(
                            "its handle must be read by exactly one `wait` and nothing else (read by {} node(s), {waits} wait(s))",
                            readers.len()
                        ),
                    ));
                }
                if g.outputs.iter().any(|o| o.value == handle) {
                    return Err(node_error(
                        i,
                        "its handle is a graph output; wait for it first".into(),
                    ));
                }
            }
            Op::Wait => {
                let from = producers[n.inputs[0].index()];
                let Some(start) =
                    from.filter(|&p| matches!(g.nodes[p].op, Op::CollectiveStart { .. }))
                else {
                    return Err(node_error(
                        i,
                        "waits on a value no collective start produced".into(),
                    ));
                };
                // A collective reads its operand until its wait: an in-place update of it
                // (a donated output) in between would change what the other ranks receive.
                let operand = g.nodes[start].inputs[0];
                if let Some(k) =
                    updated_in_place_at[operand.index()].filter(|&k| start < k && k < i)
                {
                    return Err(node_error(
                        i,
                        format!(
                            "node {k} updates %{} in place between its collective's start (node {start}) and this wait, while the collective may still read it; wait before node {k}",
                            operand.index()
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    for input in &g.inputs {
        let Some(p) = &input.placement else { continue };
        p.check(mesh, g.ty(input.value).rank())
            .map_err(|m| graph_error(format!("input `{}`: {m}", input.name)))?;
        if input.kind != InputKind::Data && p.0.iter().any(|q| matches!(q, Placement::Partial(_))) {
            return Err(graph_error(format!(
                "input `{}` is placed {p}: parameters and optimizer state are sharded or replicated, never partial",
                input.name
            )));
        }
    }
    let propagation = propagate(g, mesh).map_err(|(i, m)| node_error(i, m))?;
    for out in &g.outputs {
        let Some(declared) = &out.placement else {
            continue;
        };
        declared
            .check(mesh, g.ty(out.value).rank())
            .map_err(|m| graph_error(format!("output `{}`: {m}", out.name)))?;
        if let Some(computed) = &propagation.placements[out.value.index()] {
            if computed != declared {
                return Err(graph_error(format!(
                    "output `{}` is declared {declared} but the graph computes it {computed}",
                    out.name
                )));
            }
        }
    }
    Ok(())
}

fn verify_outputs(g: &Graph, defined_at: &[Option<Option<usize>>]) -> Result<(), VerifyError> {
    let mut names = HashSet::new();
    let mut donated = HashSet::new();
    let output_values: HashSet<ValueId> = g.outputs.iter().map(|o| o.value).collect();
    let users = g.users();
    for out in &g.outputs {
        if !names.insert(out.name.as_str()) {
            return Err(graph_error(format!(
                "output `{}` is declared twice",
                out.name
            )));
        }
        let Some(Some(def)) = defined_at.get(out.value.index()) else {
            return Err(graph_error(format!(
                "output `{}` refers to an undefined value",
                out.name
            )));
        };
        let Some(src) = out.donates else { continue };
        let Some(input) = g.inputs.iter().find(|i| i.value == src) else {
            return Err(graph_error(format!(
                "output `{}` donates a value that is not a graph input",
                out.name
            )));
        };
        if input.kind == InputKind::Data {
            return Err(graph_error(format!(
                "output `{}` donates `{}`, a data input; only param and state inputs are donated",
                out.name, input.name
            )));
        }
        if !donated.insert(src) {
            return Err(graph_error(format!(
                "input `{}` is donated twice",
                input.name
            )));
        }
        if g.ty(src) != g.ty(out.value) {
            return Err(graph_error(format!(
                "output `{}` ({}) donates `{}` of a different type ({})",
                out.name,
                g.ty(out.value),
                input.name,
                g.ty(src)
            )));
        }
        if output_values.contains(&src) {
            return Err(graph_error(format!(
                "input `{}` is donated to `{}` but is also returned itself",
                input.name, out.name
            )));
        }
        // The replacement is written by node `def` (graph inputs passed straight through are
        // caught above); any later read would see the overwritten buffer.
        if let Some(def) = def {
            if let Some(&late) = users[src.index()].iter().find(|&&u| u > *def) {
                let n = &g.nodes[late];
                return Err(VerifyError {
                    node: Some(late),
                    op: Some(n.op.name()),
                    module: n.meta.module.clone(),
                    message: format!(
                        "reads `{}` after node {def} wrote its donated replacement `{}`",
                        input.name, out.name
                    ),
                });
            }
        } else {
            return Err(graph_error(format!(
                "output `{}` donates `{}` but is itself a graph input",
                out.name, input.name
            )));
        }
    }
    Ok(())
}

/// A stage as the verifier's messages name it: "a `bwd` node", or "a `bwd` node of micro-batch 1"
/// where the step is split.
fn stage_name((micro_batch, phase): (u32, Phase)) -> String {
    match phase {
        Phase::Optimizer => "an `opt` node".to_string(),
        _ if micro_batch == 0 => format!("a `{}` node", phase.short()),
        _ => format!("a `{}` node of micro-batch {micro_batch}", phase.short()),
    }
}
