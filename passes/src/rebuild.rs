//! Rebuilding a graph node by node, for passes that replace some nodes with several (`async_tp`,
//! `bucket`): the input graph's values keep their ids, new nodes get new ones (`canonical()`
//! renumbers at the end), and `map` says which value now holds each input-graph value.

use crate::pass::PassError;
use graphtrain_ir::graph::{Meta, Node, Phase};
use graphtrain_ir::{Graph, Op, ValueId};

pub(crate) struct Rebuild {
    pub(crate) out: Graph,
    /// For each value of the input graph, the value holding it in `out`.
    pub(crate) map: Vec<ValueId>,
    /// The phase and micro-batch of the input-graph node being rewritten, which new nodes take
    /// (`enter`): a wait emitted for a backward reader of a forward collective belongs to
    /// backward, and to that reader's micro-batch.
    phase: Phase,
    micro_batch: Option<u32>,
    pass: &'static str,
}

impl Rebuild {
    /// An empty schedule over `g`'s inputs, values and outputs.
    pub(crate) fn of(g: &Graph, pass: &'static str) -> Rebuild {
        Rebuild {
            out: Graph {
                nodes: Vec::new(),
                ..g.clone()
            },
            map: (0..g.values.len() as u32).map(ValueId).collect(),
            phase: Phase::Forward,
            micro_batch: None,
            pass,
        }
    }

    /// New nodes from here on run where `at` does: its phase and micro-batch.
    pub(crate) fn enter(&mut self, at: &Meta) {
        self.phase = at.phase;
        self.micro_batch = at.micro_batch;
    }

    /// Appends a new node with `meta`, in the current phase and micro-batch.
    pub(crate) fn add(
        &mut self,
        op: Op,
        inputs: Vec<ValueId>,
        meta: &Meta,
    ) -> Result<ValueId, PassError> {
        let meta = Meta {
            phase: self.phase,
            micro_batch: self.micro_batch,
            ..meta.clone()
        };
        self.out.push1(op, inputs, meta).map_err(|e| PassError {
            pass: self.pass.into(),
            message: format!("a rewritten node does not type-check: {e:?}"),
        })
    }

    /// Appends an input-graph node as it is, reading what its operands became.
    pub(crate) fn keep(&mut self, node: &Node) {
        let inputs = node.inputs.iter().map(|v| self.map[v.index()]).collect();
        self.out.nodes.push(Node {
            inputs,
            ..node.clone()
        });
    }

    /// The rebuilt graph, its outputs reading what they became.
    pub(crate) fn finish(mut self) -> Graph {
        for o in &mut self.out.outputs {
            o.value = self.map[o.value.index()];
        }
        self.out
    }
}
