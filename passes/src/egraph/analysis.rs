//! The type analysis: every e-class knows the type of the value(s) it stands for, inferred with
//! `ir::infer::infer_types`, the single source of shape rules.
//!
//! Two classes of different types are never equal, so a union of them is a bug in a rule. egg
//! cannot veto a union from inside `merge`, so the refusal happens one step earlier: every rule
//! applier computes the type of its right side *before* adding it ([`GraphAnalysis::type_of`])
//! and skips the union when it differs, logging a [`Refusal`]. `merge` still checks, and records
//! a conflict that makes the pass fail instead of emitting a graph built on a false equality.

use super::lang::{op_of, GNode, Text};
use egg::{Analysis, DidMerge, EGraph, Id, Language};
use graphtrain_ir::{infer::infer_types, Op, TensorType};
use std::collections::HashMap;
use std::fmt;

pub type EG = EGraph<GNode, GraphAnalysis>;

/// The type of an e-class.
#[derive(Clone, Debug, PartialEq)]
pub enum ClassType {
    Tensor(TensorType),
    /// The outputs of a multi-output op, read through `get` projections.
    Tuple(Vec<TensorType>),
    /// The node does not type-check (only right sides under evaluation can be ill-typed; such
    /// nodes are never added).
    Invalid(String),
}

impl ClassType {
    pub fn tensor(&self) -> Option<&TensorType> {
        match self {
            ClassType::Tensor(t) => Some(t),
            _ => None,
        }
    }

    fn from_types(mut types: Vec<TensorType>) -> ClassType {
        if types.len() == 1 {
            ClassType::Tensor(types.remove(0))
        } else {
            ClassType::Tuple(types)
        }
    }
}

impl fmt::Display for ClassType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClassType::Tensor(t) => write!(f, "{t}"),
            ClassType::Tuple(ts) => {
                f.write_str("(")?;
                for (i, t) in ts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{t}")?;
                }
                f.write_str(")")
            }
            ClassType::Invalid(why) => write!(f, "ill-typed ({why})"),
        }
    }
}

/// A rule application skipped because its right side has another type than the matched class.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub rule: String,
    pub matched: String,
    pub replacement: String,
}

#[derive(Debug, Default)]
pub struct GraphAnalysis {
    /// Types of the graph inputs, by position.
    pub input_types: Vec<TensorType>,
    /// Parsed ops by (name, attrs), so that the attribute text is parsed once per distinct op.
    ops: HashMap<(Text, Text), Result<Op, String>>,
    /// Applications refused because they would change a type, in the order they happened.
    pub refused: Vec<Refusal>,
    /// Unions of differently typed classes that got past the appliers (a bug; fails the pass).
    pub conflicts: Vec<String>,
}

impl GraphAnalysis {
    pub fn new(input_types: Vec<TensorType>) -> Self {
        GraphAnalysis {
            input_types,
            ..Default::default()
        }
    }

    /// The op an op node stands for (cached).
    pub fn op(&mut self, name: Text, attrs: Text) -> Result<Op, String> {
        self.ops
            .entry((name, attrs))
            .or_insert_with(|| op_of(name.as_str(), attrs.as_str()))
            .clone()
    }

    /// The type `node` would have, its children being classes of `egraph` (or, through
    /// `child_type`, values not yet in it).
    pub fn type_of(&mut self, node: &GNode, child_type: impl Fn(Id) -> ClassType) -> ClassType {
        match node {
            GNode::Input(i) => match self.input_types.get(*i as usize) {
                Some(t) => ClassType::Tensor(t.clone()),
                None => ClassType::Invalid(format!("no graph input #{i}")),
            },
            GNode::Get(i, [t]) => match child_type(*t) {
                ClassType::Tuple(ts) => match ts.get(*i as usize) {
                    Some(t) => ClassType::Tensor(t.clone()),
                    None => ClassType::Invalid(format!("tuple has no output {i}")),
                },
                other => ClassType::Invalid(format!("get{i} of a non-tuple {other}")),
            },
            GNode::Op {
                name,
                attrs,
                children,
            } => {
                let op = match self.op(*name, *attrs) {
                    Ok(op) => op,
                    Err(e) => return ClassType::Invalid(e),
                };
                let mut operands = Vec::with_capacity(children.len());
                for c in children {
                    match child_type(*c) {
                        ClassType::Tensor(t) => operands.push(t),
                        other => {
                            return ClassType::Invalid(format!(
                                "operand of {} is {other}",
                                name.as_str()
                            ))
                        }
                    }
                }
                match infer_types(&op, &operands) {
                    Ok(types) => ClassType::from_types(types),
                    Err(e) => ClassType::Invalid(e),
                }
            }
        }
    }
}

fn lookup(kids: &[(Id, ClassType)], id: Id) -> ClassType {
    kids.iter()
        .find(|(k, _)| *k == id)
        .map(|(_, t)| t.clone())
        .unwrap_or_else(|| ClassType::Invalid(format!("unknown class {id}")))
}

impl Analysis<GNode> for GraphAnalysis {
    type Data = ClassType;

    fn make(egraph: &mut EG, enode: &GNode, _id: Id) -> ClassType {
        // The op cache needs `&mut` analysis while child data is read: copy the child types out.
        let kids: Vec<(Id, ClassType)> = enode
            .children()
            .iter()
            .map(|&c| (c, egraph[c].data.clone()))
            .collect();
        egraph.analysis.type_of(enode, |id| lookup(&kids, id))
    }

    fn merge(&mut self, a: &mut ClassType, b: ClassType) -> DidMerge {
        if *a == b {
            return DidMerge(false, false);
        }
        self.conflicts
            .push(format!("merged a class of type {a} with one of type {b}"));
        DidMerge(false, true)
    }
}
