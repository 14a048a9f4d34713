//! What a rule is, and how it becomes an egg `Rewrite`.
//!
//! Two kinds share one type-checked application step:
//! - pattern rules (built-in ones written in the rule-file syntax, and rule files): an egg
//!   `Pattern` on the left, a pattern on the right, conditions on the types of the variables;
//! - native rules: a Rust function that looks at one matched node and computes its replacement,
//!   for rewrites whose attributes are computed (composed permutations, folded constants) and
//!   so cannot be written as a fixed pattern.
//!
//! Every application computes the type of the right side from the matched classes before adding
//! anything; if it differs from the matched class's type the application is refused and logged
//! in the analysis, so a wrong rule can never make two differently typed values equal.

use super::analysis::{ClassType, GraphAnalysis, Refusal, EG};
use super::lang::{GNode, Text};
use crate::pass::Tier;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};
use egg::{ENodeOrVar, Language};
use graphtrain_ir::{DType, Op, TensorType};
use std::fmt;

/// A condition on the type of a pattern variable (`dtype(?x) == f32`).
#[derive(Clone, Debug, PartialEq)]
pub struct Cond {
    pub var: Var,
    pub what: CondKind,
    /// `==` when true, `!=` when false.
    pub equal: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CondKind {
    Dtype(DType),
    Shape(Vec<usize>),
    Rank(usize),
}

impl Cond {
    pub fn holds(&self, t: &TensorType) -> bool {
        let same = match &self.what {
            CondKind::Dtype(d) => t.dtype == *d,
            CondKind::Shape(s) => t.shape == *s,
            CondKind::Rank(r) => t.rank() == *r,
        };
        same == self.equal
    }
}

impl fmt::Display for Cond {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.equal { "==" } else { "!=" };
        match &self.what {
            CondKind::Dtype(d) => write!(f, "dtype({}) {op} {d}", self.var),
            CondKind::Shape(s) => write!(f, "shape({}) {op} {s:?}", self.var),
            CondKind::Rank(r) => write!(f, "rank({}) {op} {r}", self.var),
        }
    }
}

/// The replacement a native rule computes: existing classes combined by new ops.
#[derive(Clone, Debug)]
pub enum Rhs {
    Class(Id),
    Node(Op, Vec<Rhs>),
}

/// A native rule: given a node whose op is the rule's root op, its replacements (usually zero or
/// one; several when a child class offers several matching nodes).
pub type NativeFn = fn(&EG, &GNode) -> Vec<Rhs>;

#[derive(Clone)]
pub enum RuleKind {
    Pattern {
        lhs: Pattern<GNode>,
        rhs: PatternAst<GNode>,
        conds: Vec<Cond>,
    },
    Native {
        root: &'static str,
        f: NativeFn,
    },
}

/// One directional rewrite rule.
#[derive(Clone)]
pub struct Rule {
    pub name: String,
    /// The group it belongs to (`algebra`, `layout`, ...).
    pub topic: String,
    pub tier: Tier,
    /// The one-line math comment (`x * 1 → x`).
    pub math: String,
    pub kind: RuleKind,
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} [{}] {:?}: {}",
            self.name, self.topic, self.tier, self.math
        )?;
        if let RuleKind::Pattern { lhs, rhs, conds } = &self.kind {
            write!(f, " ({lhs} => {rhs}")?;
            for c in conds {
                write!(f, " if {c}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl Rule {
    pub fn to_rewrite(&self) -> Result<Rewrite<GNode, GraphAnalysis>, String> {
        let name = Symbol::from(self.name.as_str());
        match &self.kind {
            RuleKind::Pattern { lhs, rhs, conds } => Rewrite::new(
                name,
                lhs.clone(),
                PatternApplier {
                    rule: self.name.clone(),
                    rhs: rhs.clone(),
                    conds: conds.clone(),
                },
            ),
            RuleKind::Native { root, f } => Rewrite::new(
                name,
                NativeSearcher {
                    root: Text::new(root),
                    f: *f,
                },
                NativeApplier {
                    rule: self.name.clone(),
                    f: *f,
                },
            ),
        }
    }
}

struct PatternApplier {
    rule: String,
    rhs: PatternAst<GNode>,
    conds: Vec<Cond>,
}

impl Applier<GNode, GraphAnalysis> for PatternApplier {
    fn apply_one(
        &self,
        egraph: &mut EG,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<GNode>>,
        _rule_name: Symbol,
    ) -> Vec<Id> {
        for c in &self.conds {
            let holds = subst
                .get(c.var)
                .and_then(|id| egraph[*id].data.tensor())
                .is_some_and(|t| c.holds(t));
            if !holds {
                return Vec::new();
            }
        }
        let nodes = self.rhs.as_ref();
        // Type of every right-side node, computed before anything is added.
        let mut types: Vec<ClassType> = Vec::with_capacity(nodes.len());
        for n in nodes {
            let t = match n {
                ENodeOrVar::Var(v) => match subst.get(*v) {
                    Some(id) => egraph[*id].data.clone(),
                    None => ClassType::Invalid(format!("unbound {v}")),
                },
                ENodeOrVar::ENode(node) => egraph
                    .analysis
                    .type_of(node, |i| types[usize::from(i)].clone()),
            };
            types.push(t);
        }
        let Some(rhs_type) = types.last() else {
            return Vec::new();
        };
        if !check_type(egraph, &self.rule, eclass, rhs_type, || {
            self.rhs.to_string()
        }) {
            return Vec::new();
        }
        let mut ids: Vec<Id> = Vec::with_capacity(nodes.len());
        for n in nodes {
            let id = match n {
                ENodeOrVar::Var(v) => subst[*v],
                ENodeOrVar::ENode(node) => {
                    egraph.add(node.clone().map_children(|i| ids[usize::from(i)]))
                }
            };
            ids.push(id);
        }
        union(egraph, eclass, ids.last().copied())
    }

    fn vars(&self) -> Vec<Var> {
        self.rhs
            .as_ref()
            .iter()
            .filter_map(|n| match n {
                ENodeOrVar::Var(v) => Some(*v),
                ENodeOrVar::ENode(_) => None,
            })
            .collect()
    }
}

/// Compares the right side's type with the matched class's; logs a refusal when they differ.
fn check_type(
    egraph: &mut EG,
    rule: &str,
    eclass: Id,
    rhs_type: &ClassType,
    describe: impl Fn() -> String,
) -> bool {
    let want = &egraph[eclass].data;
    if want == rhs_type {
        return true;
    }
    let refusal = Refusal {
        rule: rule.to_string(),
        matched: want.to_string(),
        replacement: format!("{} : {rhs_type}", describe()),
    };
    egraph.analysis.refused.push(refusal);
    false
}

fn union(egraph: &mut EG, eclass: Id, new: Option<Id>) -> Vec<Id> {
    match new {
        Some(id) if egraph.union(eclass, id) => vec![eclass],
        _ => Vec::new(),
    }
}

struct NativeSearcher {
    root: Text,
    f: NativeFn,
}

impl Searcher<GNode, GraphAnalysis> for NativeSearcher {
    fn search_eclass_with_limit(
        &self,
        egraph: &EG,
        eclass: Id,
        limit: usize,
    ) -> Option<SearchMatches<'_, GNode>> {
        let hit = limit > 0
            && egraph[eclass].nodes.iter().any(|n| {
                matches!(n, GNode::Op { name, .. } if *name == self.root)
                    && !(self.f)(egraph, n).is_empty()
            });
        // The applier recomputes the replacements from the class, so the match carries nothing.
        hit.then(|| SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None,
        })
    }

    fn search_with_limit(&self, egraph: &EG, mut limit: usize) -> Vec<SearchMatches<'_, GNode>> {
        let mut out = Vec::new();
        let Some(classes) = egraph.classes_for_op(&super::lang::Disc::Op(self.root)) else {
            return out;
        };
        for id in classes {
            if limit == 0 {
                break;
            }
            if let Some(m) = self.search_eclass_with_limit(egraph, id, limit) {
                limit -= m.substs.len();
                out.push(m);
            }
        }
        out
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

struct NativeApplier {
    rule: String,
    f: NativeFn,
}

impl Applier<GNode, GraphAnalysis> for NativeApplier {
    fn apply_one(
        &self,
        egraph: &mut EG,
        eclass: Id,
        _subst: &Subst,
        _searcher_ast: Option<&PatternAst<GNode>>,
        _rule_name: Symbol,
    ) -> Vec<Id> {
        let rhss: Vec<Rhs> = egraph[eclass]
            .nodes
            .iter()
            .flat_map(|n| (self.f)(egraph, n))
            .collect();
        let mut changed = Vec::new();
        for rhs in rhss {
            let ty = rhs_type(egraph, &rhs);
            if check_type(egraph, &self.rule, eclass, &ty, || describe(&rhs)) {
                let id = add_rhs(egraph, &rhs);
                changed.extend(union(egraph, eclass, Some(id)));
            }
        }
        changed
    }
}

fn rhs_type(egraph: &mut EG, rhs: &Rhs) -> ClassType {
    match rhs {
        Rhs::Class(id) => egraph[*id].data.clone(),
        Rhs::Node(op, kids) => {
            let types: Vec<ClassType> = kids.iter().map(|k| rhs_type(egraph, k)).collect();
            let node = GNode::op(op, (0..kids.len()).map(Id::from).collect());
            egraph
                .analysis
                .type_of(&node, |i| types[usize::from(i)].clone())
        }
    }
}

fn add_rhs(egraph: &mut EG, rhs: &Rhs) -> Id {
    match rhs {
        Rhs::Class(id) => *id,
        Rhs::Node(op, kids) => {
            let children = kids.iter().map(|k| add_rhs(egraph, k)).collect();
            egraph.add(GNode::op(op, children))
        }
    }
}

fn describe(rhs: &Rhs) -> String {
    match rhs {
        Rhs::Class(id) => format!("class {id}"),
        Rhs::Node(op, kids) => {
            let kids: Vec<String> = kids.iter().map(describe).collect();
            format!("({} {})", op.name(), kids.join(" "))
        }
    }
}
