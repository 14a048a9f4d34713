//! The graph: typed values, graph inputs (data, parameters, optimizer state), nodes in schedule
//! order, and named outputs that may donate an input's buffer.

use crate::dtype::TensorType;
use crate::infer::infer_types;
use crate::mesh::{Mesh, Placements};
use crate::op::Op;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a value in `Graph::values`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Which part of the train step a node belongs to. Nodes appear in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    Forward,
    Loss,
    Backward,
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 4] = [
        Phase::Forward,
        Phase::Loss,
        Phase::Backward,
        Phase::Optimizer,
    ];

    /// Short name used in the text format.
    pub fn short(self) -> &'static str {
        match self {
            Phase::Forward => "fwd",
            Phase::Loss => "loss",
            Phase::Backward => "bwd",
            Phase::Optimizer => "opt",
        }
    }

    pub fn from_short(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.short() == s)
    }
}

/// What activation-memory policy chose for a node's outputs (set by policy passes, read by the
/// passes that act on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Remat {
    Save,
    Recompute,
    Offload,
}

impl Remat {
    pub fn name(self) -> &'static str {
        match self {
            Remat::Save => "save",
            Remat::Recompute => "recompute",
            Remat::Offload => "offload",
        }
    }

    pub fn from_name(s: &str) -> Option<Remat> {
        [Remat::Save, Remat::Recompute, Remat::Offload]
            .into_iter()
            .find(|r| r.name() == s)
    }
}

/// Tags that passes put on nodes. Empty on a freshly traced graph.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tags {
    pub remat: Option<Remat>,
    pub bucket: Option<u32>,
    pub stream: Option<u32>,
    pub region: Option<u32>,
}

/// Per-node metadata that almost every pass needs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Meta {
    /// Module path of the code that made the node, such as `layers.3.feed_forward.w1`.
    pub module: String,
    pub phase: Phase,
    /// Transformer layer index, when the node belongs to one.
    pub layer: Option<u32>,
    pub tags: Tags,
    /// The micro-batch whose forward or backward the node belongs to, in a step whose batch is
    /// split into micro-batches (`micro_batches.rs`); `None` in a step that is not split, and
    /// on every optimizer node.
    #[serde(default)]
    pub micro_batch: Option<u32>,
}

impl Meta {
    /// Metadata for `module` in `phase`, with the layer taken from a `layers.N` path prefix.
    pub fn new(module: impl Into<String>, phase: Phase) -> Self {
        let module = module.into();
        let layer = layer_from_module(&module);
        Meta {
            module,
            phase,
            layer,
            tags: Tags::default(),
            micro_batch: None,
        }
    }

    /// Where the node runs in the step: micro-batch by micro-batch, each one's forward, loss and
    /// backward, then the optimizer once. Nodes appear in this order (the verifier checks it);
    /// in a step that is not split every node is micro-batch 0, so this is the phase order.
    pub fn stage(&self) -> (u32, Phase) {
        match self.phase {
            Phase::Optimizer => (u32::MAX, Phase::Optimizer),
            phase => (self.micro_batch.unwrap_or(0), phase),
        }
    }
}

impl Default for Meta {
    fn default() -> Self {
        Meta::new("", Phase::Forward)
    }
}

/// `layers.3.attention.wq` -> `Some(3)`.
pub fn layer_from_module(module: &str) -> Option<u32> {
    let rest = module.strip_prefix("layers.")?;
    let idx = rest.split('.').next()?;
    idx.parse().ok()
}

/// What a graph input holds; decides what the trainer feeds and what may be donated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InputKind {
    /// Fed fresh every step (tokens, targets, learning rate, step count).
    Data,
    /// A trainable parameter.
    Param,
    /// Optimizer state (AdamW moments).
    State,
}

impl InputKind {
    pub fn keyword(self) -> &'static str {
        match self {
            InputKind::Data => "input",
            InputKind::Param => "param",
            InputKind::State => "state",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub name: String,
    pub kind: InputKind,
    pub value: ValueId,
    /// How the ranks hold the global tensor this local input is part of (graphs with a mesh).
    #[serde(default)]
    pub placement: Option<Placements>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Output {
    pub name: String,
    pub value: ValueId,
    /// The input whose buffer this output overwrites (in-place update).
    pub donates: Option<ValueId>,
    /// How the ranks hold the global tensor this local output is part of (graphs with a mesh).
    #[serde(default)]
    pub placement: Option<Placements>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub meta: Meta,
}

/// A dataflow graph. `nodes` is in schedule order: a node may only read graph inputs and outputs
/// of earlier nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub name: String,
    /// Type of every value, indexed by `ValueId`.
    pub values: Vec<TensorType>,
    pub inputs: Vec<Input>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<Output>,
    /// The device mesh of an SPMD graph: every rank runs this graph on its own local tensors, and
    /// collective nodes combine them. `None` for a single-device graph.
    #[serde(default)]
    pub mesh: Option<Mesh>,
}

/// A node that could not be added: the op rejected its operand types.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeError {
    pub op: &'static str,
    pub module: String,
    pub operands: Vec<TensorType>,
    pub message: String,
}

impl fmt::Display for TypeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let module = if self.module.is_empty() {
            "<root>"
        } else {
            &self.module
        };
        write!(f, "in `{module}`: {}(", self.op)?;
        for (i, t) in self.operands.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{t}")?;
        }
        write!(f, "): {}", self.message)
    }
}

impl std::error::Error for TypeError {}

impl Graph {
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            values: Vec::new(),
            inputs: Vec::new(),
            nodes: Vec::new(),
            outputs: Vec::new(),
            mesh: None,
        }
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.values[v.index()]
    }

    fn new_value(&mut self, ty: TensorType) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(ty);
        id
    }

    pub fn add_input(
        &mut self,
        name: impl Into<String>,
        kind: InputKind,
        ty: TensorType,
    ) -> ValueId {
        let value = self.new_value(ty);
        self.inputs.push(Input {
            name: name.into(),
            kind,
            value,
            placement: None,
        });
        value
    }

    /// Appends a node after inferring its output types; refuses operands the op cannot take.
    pub fn push(
        &mut self,
        op: Op,
        inputs: Vec<ValueId>,
        meta: Meta,
    ) -> Result<Vec<ValueId>, TypeError> {
        let operands: Vec<TensorType> = inputs.iter().map(|v| self.ty(*v).clone()).collect();
        let types = infer_types(&op, &operands).map_err(|message| TypeError {
            op: op.name(),
            module: meta.module.clone(),
            operands,
            message,
        })?;
        Ok(self.push_typed(op, inputs, types, meta))
    }

    /// Appends a node with a single output.
    pub fn push1(
        &mut self,
        op: Op,
        inputs: Vec<ValueId>,
        meta: Meta,
    ) -> Result<ValueId, TypeError> {
        Ok(self.push(op, inputs, meta)?[0])
    }

    /// Appends a node whose output types are given (used by the parser; the verifier checks them).
    pub fn push_typed(
        &mut self,
        op: Op,
        inputs: Vec<ValueId>,
        types: Vec<TensorType>,
        meta: Meta,
    ) -> Vec<ValueId> {
        let outputs: Vec<ValueId> = types.into_iter().map(|t| self.new_value(t)).collect();
        self.nodes.push(Node {
            op,
            inputs,
            outputs: outputs.clone(),
            meta,
        });
        outputs
    }

    pub fn add_output(
        &mut self,
        name: impl Into<String>,
        value: ValueId,
        donates: Option<ValueId>,
    ) {
        self.outputs.push(Output {
            name: name.into(),
            value,
            donates,
            placement: None,
        });
    }

    /// Copies the mesh and the input and output placements of `from`, a graph with the same
    /// inputs and outputs in the same order: for passes that rebuild a graph node by node.
    pub fn keep_distribution_of(&mut self, from: &Graph) {
        self.mesh = from.mesh.clone();
        for (to, from) in self.inputs.iter_mut().zip(&from.inputs) {
            to.placement = from.placement.clone();
        }
        for (to, from) in self.outputs.iter_mut().zip(&from.outputs) {
            to.placement = from.placement.clone();
        }
    }

    pub fn input_named(&self, name: &str) -> Option<&Input> {
        self.inputs.iter().find(|i| i.name == name)
    }

    pub fn output_named(&self, name: &str) -> Option<&Output> {
        self.outputs.iter().find(|o| o.name == name)
    }

    /// For every value, the index of the node that defines it (`None` for graph inputs and values
    /// nothing defines).
    pub fn producers(&self) -> Vec<Option<usize>> {
        let mut producer = vec![None; self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for o in &n.outputs {
                producer[o.index()] = Some(i);
            }
        }
        producer
    }

    /// For every value, the indices of the nodes that read it, in schedule order.
    pub fn users(&self) -> Vec<Vec<usize>> {
        let mut users = vec![Vec::new(); self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for v in &n.inputs {
                if users[v.index()].last() != Some(&i) {
                    users[v.index()].push(i);
                }
            }
        }
        users
    }

    /// Renumbers values so that graph inputs come first (in signature order) and node outputs
    /// follow in schedule order, dropping values that nothing defines. The text format prints
    /// this numbering, so `parse(print(g)) == g.canonical()`.
    pub fn canonical(&self) -> Graph {
        let mut map: Vec<Option<ValueId>> = vec![None; self.values.len()];
        let mut values = Vec::with_capacity(self.values.len());
        let mut assign = |v: ValueId, values: &mut Vec<TensorType>| {
            let id = ValueId(values.len() as u32);
            values.push(self.values[v.index()].clone());
            map[v.index()] = Some(id);
        };
        for i in &self.inputs {
            assign(i.value, &mut values);
        }
        for n in &self.nodes {
            for o in &n.outputs {
                assign(*o, &mut values);
            }
        }
        // Values read but never defined stay broken for the verifier to report: give them fresh
        // ids after everything else.
        let remap =
            |v: ValueId, map: &mut Vec<Option<ValueId>>, values: &mut Vec<TensorType>| -> ValueId {
                if let Some(id) = map[v.index()] {
                    id
                } else {
                    let id = ValueId(values.len() as u32);
                    values.push(self.values[v.index()].clone());
                    map[v.index()] = Some(id);
                    id
                }
            };
        let inputs = self
            .inputs
            .iter()
            .map(|i| Input {
                name: i.name.clone(),
                kind: i.kind,
                value: map[i.value.index()].expect("inputs are assigned first"),
                placement: i.placement.clone(),
            })
            .collect();
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for n in &self.nodes {
            let ins = n
                .inputs
                .iter()
                .map(|v| remap(*v, &mut map, &mut values))
                .collect();
            let outs = n
                .outputs
                .iter()
                .map(|v| remap(*v, &mut map, &mut values))
                .collect();
            nodes.push(Node {
                op: n.op.clone(),
                inputs: ins,
                outputs: outs,
                meta: n.meta.clone(),
            });
        }
        let outputs = self
            .outputs
            .iter()
            .map(|o| Output {
                name: o.name.clone(),
                value: remap(o.value, &mut map, &mut values),
                donates: o.donates.map(|d| remap(d, &mut map, &mut values)),
                placement: o.placement.clone(),
            })
            .collect();
        Graph {
            name: self.name.clone(),
            values,
            inputs,
            nodes,
            outputs,
            mesh: self.mesh.clone(),
        }
    }

    /// Whether value ids already follow the canonical numbering.
    pub fn is_canonical(&self) -> bool {
        *self == self.canonical()
    }

    /// The node-level dataflow graph (edge a -> b when b reads a value a defines), for the
    /// algorithms petgraph provides.
    pub fn dataflow(&self) -> petgraph::graph::DiGraph<usize, ValueId> {
        let mut g = petgraph::graph::DiGraph::with_capacity(self.nodes.len(), self.nodes.len() * 2);
        let idx: Vec<_> = (0..self.nodes.len()).map(|i| g.add_node(i)).collect();
        let producer = self.producers();
        for (i, n) in self.nodes.iter().enumerate() {
            for v in &n.inputs {
                if let Some(p) = producer[v.index()] {
                    g.add_edge(idx[p], idx[i], *v);
                }
            }
        }
        g
    }

    /// Nodes whose outputs are (transitively) needed to compute `targets`.
    pub fn needed_for(&self, targets: &[ValueId]) -> Vec<bool> {
        let mut needed = vec![false; self.nodes.len()];
        let mut live = vec![false; self.values.len()];
        for t in targets {
            live[t.index()] = true;
        }
        for (i, n) in self.nodes.iter().enumerate().rev() {
            if n.outputs.iter().any(|o| live[o.index()]) {
                needed[i] = true;
                for v in &n.inputs {
                    live[v.index()] = true;
                }
            }
        }
        needed
    }

    /// How many micro-batches the step's batch is split into (`micro_batches.rs`): 1 for a step
    /// that is not split.
    pub fn micro_batches(&self) -> u32 {
        self.nodes
            .iter()
            .filter_map(|n| n.meta.micro_batch)
            .max()
            .map_or(1, |last| last + 1)
    }

    /// Count of nodes per op name, sorted by name.
    pub fn op_histogram(&self) -> Vec<(&'static str, usize)> {
        let mut m = std::collections::BTreeMap::new();
        for n in &self.nodes {
            *m.entry(n.op.name()).or_insert(0usize) += 1;
        }
        m.into_iter().collect()
    }
}
