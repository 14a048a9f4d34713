//! Value substitution and graph rebuild, shared by the passes that drop or replace nodes
//! (`canonicalize`, `cse`, `dce`): a replace-all-uses [`Substitution`], a [`rebuild`] that drops
//! nodes and renumbers canonically, and [`op_counts`] for their reports; plus
//! [`is_recompute_copy`], which every pass that merges or folds nodes (`egraph` included) asks
//! before touching activation checkpointing's copies. Nothing here is the `rewrite` pass, which
//! applies a rule file through the e-graph (`egraph/`).

use graphtrain_ir::{Graph, Node, Phase, Remat, ValueId};

/// Replace-all-uses records: `get(v)` follows `v -> w -> ...` to the final replacement.
#[derive(Clone, Debug)]
pub struct Substitution {
    to: Vec<ValueId>,
}

impl Substitution {
    pub fn new(g: &Graph) -> Self {
        Substitution {
            to: (0..g.values.len() as u32).map(ValueId).collect(),
        }
    }

    /// Every later use of `from` reads `to` instead.
    pub fn set(&mut self, from: ValueId, to: ValueId) {
        self.to[from.index()] = to;
    }

    pub fn get(&self, mut v: ValueId) -> ValueId {
        while self.to[v.index()] != v {
            v = self.to[v.index()];
        }
        v
    }

    pub fn is_identity(&self) -> bool {
        self.to.iter().enumerate().all(|(i, v)| v.index() == i)
    }
}

/// A copy of `g` keeping the nodes where `keep` is true (in order), with `nodes` replacing the
/// original node bodies and every operand and output passed through `subst`; canonically numbered.
pub fn rebuild(g: &Graph, nodes: Vec<Node>, keep: &[bool], subst: &Substitution) -> Graph {
    let mut out = g.clone();
    out.nodes = nodes
        .into_iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|(mut n, _)| {
            for v in &mut n.inputs {
                *v = subst.get(*v);
            }
            n
        })
        .collect();
    for o in &mut out.outputs {
        o.value = subst.get(o.value);
    }
    out.canonical()
}

/// Counts per op name of the nodes where `mask` is true, as `name ×n` text.
pub fn op_counts(g: &Graph, mask: impl Fn(usize) -> bool) -> String {
    let mut counts = std::collections::BTreeMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if mask(i) {
            *counts.entry(n.op.name()).or_insert(0usize) += 1;
        }
    }
    counts
        .iter()
        .map(|(k, v)| format!("{k} ×{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A backward copy that activation checkpointing (`remat`) made on purpose, so that a forward
/// value need not stay alive. Passes that merge or fold nodes must not fold such a copy back into
/// the forward nodes it duplicates, or the memory saving is silently undone.
pub fn is_recompute_copy(n: &Node) -> bool {
    n.meta.phase >= Phase::Backward && n.meta.tags.remat == Some(Remat::Recompute)
}
