//! Rewrite rules as pure functions over ops, written once and drawn on by two passes:
//! `canonicalize`, which applies them to graph nodes in schedule order, and `egraph`, whose
//! native rules (`egraph/rules.rs`) apply them to e-classes.
//!
//! Contract: a rule sees one op with its attributes, its operand (a handle `V` the caller
//! chooses: a `ValueId` in `canonicalize`, an e-class `Id` in `egraph`), that operand's type
//! where the rule needs it, and, for chain rules, the op that produces the operand and the
//! producer's own operand. It answers with an [`Outcome`] (forward the operand, or replace the
//! node by one op on one value) or `None` (no rule). It never looks at a graph: how a pass finds
//! nodes, which producers it may look through (`canonicalize` does not fold a recompute copy
//! into a forward node), and what it does with the outcome (substitute, or add an equivalent form
//! to an e-class) stay in the pass.
//!
//! Every rule is directional (left becomes right) and tier 1: exact in IEEE arithmetic. Layout
//! ops move elements without arithmetic; the scalar rules are exact for every input (NaN payloads
//! aside). The rules, by topic:
//! - `layout`: transpose-identity, transpose-pair, reshape-identity, reshape-chain,
//!   expand-identity, slice-full, concat-single (both passes);
//! - `cast`: cast-identity (both passes);
//! - `scalar`: mul-one, add-neg-zero (`canonicalize` only: the e-graph states these two as the
//!   pattern rules `mul-one` and `add-neg-zero` in the rule-file syntax, `RULES_TIER1` in
//!   `egraph/rules.rs`, which egg matches directly).
//!
//! Rules only one pass has (the e-graph's cast round trip, constants and reassociation) stay with
//! that pass.

pub mod cast;
pub mod layout;
pub mod scalar;

use graphtrain_ir::Op;

/// What a rule makes of the node it matched; `V` is the caller's handle on a value.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome<V> {
    /// The node's value equals this value: forward it.
    Forward(V),
    /// The node's value equals this op applied to this one value.
    Replace(Op, V),
}
