//! The built-in rules, grouped by topic. Each is directional (left becomes right in the e-graph,
//! where both then coexist until extraction picks one) and carries the math as a one-line
//! comment.
//!
//! Tier 1 holds only rewrites that are exact in IEEE arithmetic: the result is bitwise the same
//! for every input (NaN payloads aside). Not in tier 1, on purpose: `x + 0 → x` (-0 + 0 = +0),
//! reassociation, `x / c → x * (1/c)` unless c is a power of two. Those live in the tier-2 group,
//! enabled by the `tier2` option, which makes the pass tier 2.
//!
//! Rules whose right side is a fixed pattern are written in the rule-file syntax (`RULES_TIER1`,
//! parsed by `rulefile.rs`, which also checks them); rules that compute attributes (composed
//! permutations, folded constants) are native Rust functions. The native layout and cast rules
//! that `canonicalize` applies too only delegate: their conditions and results are written once,
//! in `crate::rules`; this table keeps their names, topics, tiers and math.

use super::analysis::EG;
use super::lang::{op_of, GNode};
use super::rule::{NativeFn, Rhs, Rule, RuleKind};
use super::rulefile::parse_rules;
use crate::pass::Tier;
use crate::rules::{cast, layout, Outcome};
use egg::Id;
use graphtrain_ir::interp::round_to_dtype;
use graphtrain_ir::{DType, Op, TensorType};

/// Pattern rules, tier 1.
const RULES_TIER1: &str = "
tier 1
[algebra]
# x * 1 → x                 (multiplying by one is exact)
mul-one: (mul_scalar ?x value=1.0) => ?x
# x + (-0) → x              (exact; x + (+0) is not: -0 + +0 = +0)
add-neg-zero: (add_scalar ?x value=-0.0) => ?x
# -(-x) → x
neg-neg: (neg (neg ?x)) => ?x
# |-x| → |x|
abs-neg: (abs (neg ?x)) => (abs ?x)
# (-a) · (-b) → a · b       (sign flips are exact)
neg-mul-neg: (mul (neg ?a) (neg ?b)) => (mul ?a ?b)
# a + b → b + a             (IEEE addition commutes; lets hashconsing merge b + a with a + b)
add-commute: (add ?a ?b) => (add ?b ?a)
# a · b → b · a             (IEEE multiplication commutes)
mul-commute: (mul ?a ?b) => (mul ?b ?a)
";

/// Native rules: (topic, name, tier, math, root op, function).
const NATIVE: &[(&str, &str, Tier, &str, &str, NativeFn)] = &[
    (
        "layout",
        "transpose-identity",
        Tier::Preserving,
        "transpose(x, identity) → x",
        "transpose",
        transpose_identity,
    ),
    (
        "layout",
        "transpose-pair",
        Tier::Preserving,
        "transpose(transpose(x, p), q) → transpose(x, p∘q)",
        "transpose",
        transpose_pair,
    ),
    (
        "layout",
        "reshape-identity",
        Tier::Preserving,
        "reshape(x, shape(x)) → x",
        "reshape",
        reshape_identity,
    ),
    (
        "layout",
        "reshape-chain",
        Tier::Preserving,
        "reshape(reshape(x, s1), s2) → reshape(x, s2)",
        "reshape",
        reshape_chain,
    ),
    (
        "layout",
        "expand-identity",
        Tier::Preserving,
        "expand(x, shape(x)) → x",
        "expand",
        expand_identity,
    ),
    (
        "layout",
        "slice-full",
        Tier::Preserving,
        "slice(x, a, 0, dim_a(x)) → x",
        "slice",
        slice_full,
    ),
    (
        "layout",
        "concat-single",
        Tier::Preserving,
        "concat(x) → x",
        "concat",
        concat_single,
    ),
    (
        "cast",
        "cast-identity",
        Tier::Preserving,
        "cast(x, dtype(x)) → x",
        "cast",
        cast_identity,
    ),
    (
        "cast",
        "cast-roundtrip",
        Tier::Preserving,
        "cast(cast(x, wider), dtype(x)) → x   (widening is exact, so is narrowing back)",
        "cast",
        cast_roundtrip,
    ),
    (
        "constants",
        "mul-full",
        Tier::Preserving,
        "x · full(c) → x * c   (when c is exact in x's dtype)",
        "mul",
        mul_full,
    ),
    (
        "constants",
        "div-pow2",
        Tier::Preserving,
        "x / full(2^k) → x * 2^-k   (scaling by a power of two is exact)",
        "div",
        div_pow2,
    ),
    (
        "reassociate",
        "div-const",
        Tier::Changing,
        "x / full(c) → x * (1/c)   (1/c rounds)",
        "div",
        div_const,
    ),
    (
        "reassociate",
        "scale-chain",
        Tier::Changing,
        "(x * a) * b → x * (a·b)",
        "mul_scalar",
        scale_chain,
    ),
    (
        "reassociate",
        "shift-chain",
        Tier::Changing,
        "(x + a) + b → x + (a+b)",
        "add_scalar",
        shift_chain,
    ),
];

/// Every built-in rule, tier 1 first.
pub fn builtin_rules() -> Vec<Rule> {
    // The text is a constant checked by `builtin_rules_parse`; an error here is a programming
    // error in this file, caught by every test that runs the pass.
    let mut rules = parse_rules("<builtin>", RULES_TIER1)
        .unwrap_or_else(|e| panic!("built-in rules do not parse: {e}"))
        .rules;
    rules.extend(
        NATIVE
            .iter()
            .map(|&(topic, name, tier, math, root, f)| Rule {
                name: name.to_string(),
                topic: topic.to_string(),
                tier,
                math: math.to_string(),
                kind: RuleKind::Native { root, f },
            }),
    );
    rules
}

/// The rules a tier allows: tier 1 only, or everything.
pub fn rules_for(tier: Tier) -> Vec<Rule> {
    builtin_rules()
        .into_iter()
        .filter(|r| tier == Tier::Changing || r.tier == Tier::Preserving)
        .collect()
}

// ---- helpers

/// The op and operands of an op node.
fn parts(n: &GNode) -> Option<(Op, &[Id])> {
    match n {
        GNode::Op {
            name,
            attrs,
            children,
        } => op_of(name.as_str(), attrs.as_str())
            .ok()
            .map(|op| (op, children.as_slice())),
        _ => None,
    }
}

/// The op nodes of class `id` (with their operands).
fn ops_in(eg: &EG, id: Id) -> impl Iterator<Item = (Op, Vec<Id>)> + '_ {
    eg[id]
        .nodes
        .iter()
        .filter_map(|n| parts(n).map(|(op, kids)| (op, kids.to_vec())))
}

/// The value of a `full` constant in class `id`, with its dtype.
fn constant(eg: &EG, id: Id) -> Option<(f64, DType)> {
    ops_in(eg, id).find_map(|(op, _)| match op {
        Op::Full { value, dtype, .. } => Some((value, dtype)),
        _ => None,
    })
}

// ---- rules shared with `canonicalize`: their conditions and results are in `crate::rules`

/// The replacement for a shared rule's outcome.
fn rhs(outcome: Outcome<Id>) -> Rhs {
    match outcome {
        Outcome::Forward(x) => Rhs::Class(x),
        Outcome::Replace(op, x) => Rhs::Node(op, vec![Rhs::Class(x)]),
    }
}

/// A shared rule that looks at the node's op and its operands.
fn on_operands(n: &GNode, rule: impl Fn(&Op, &[Id]) -> Option<Outcome<Id>>) -> Vec<Rhs> {
    parts(n)
        .and_then(|(op, kids)| rule(&op, kids))
        .map(rhs)
        .into_iter()
        .collect()
}

/// A shared rule that looks at a one-operand node's op and its operand.
fn on_operand(n: &GNode, rule: impl Fn(&Op, Id) -> Option<Outcome<Id>>) -> Vec<Rhs> {
    on_operands(n, |op, kids| match kids {
        [x] => rule(op, *x),
        _ => None,
    })
}

/// A shared rule that also needs the operand's type (no rule when the operand is not a tensor).
fn on_typed_operand(
    eg: &EG,
    n: &GNode,
    rule: impl Fn(&Op, Id, &TensorType) -> Option<Outcome<Id>>,
) -> Vec<Rhs> {
    on_operand(n, |op, x| rule(op, x, eg[x].data.tensor()?))
}

/// A shared chain rule on a one-operand `root` node: one replacement per one-operand node of
/// the operand's class that the rule accepts as the inner op.
fn on_chain(
    eg: &EG,
    n: &GNode,
    root: &str,
    rule: impl Fn(&Op, &Op, Id) -> Option<Outcome<Id>>,
) -> Vec<Rhs> {
    if n.op_name() != Some(root) {
        return vec![];
    }
    let Some((op, [x])) = parts(n) else {
        return vec![];
    };
    ops_in(eg, *x)
        .filter_map(|(inner, kids)| match kids.as_slice() {
            [src] => rule(&op, &inner, *src).map(rhs),
            _ => None,
        })
        .collect()
}

// ---- layout

// transpose(x, identity) → x
fn transpose_identity(_: &EG, n: &GNode) -> Vec<Rhs> {
    on_operand(n, layout::transpose_identity)
}

// transpose(transpose(x, p), q) → transpose(x, p∘q), or x when p∘q is the identity
fn transpose_pair(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_chain(eg, n, "transpose", layout::transpose_pair)
}

// reshape(x, shape(x)) → x
fn reshape_identity(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_typed_operand(eg, n, layout::reshape_identity)
}

// reshape(reshape(x, s1), s2) → reshape(x, s2)   (row-major order is kept by both)
fn reshape_chain(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_chain(eg, n, "reshape", layout::reshape_chain)
}

// expand(x, shape(x)) → x
fn expand_identity(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_typed_operand(eg, n, layout::expand_identity)
}

// slice(x, axis, 0, dim(x, axis)) → x
fn slice_full(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_typed_operand(eg, n, layout::slice_full)
}

// concat(x) → x
fn concat_single(_: &EG, n: &GNode) -> Vec<Rhs> {
    on_operands(n, layout::concat_single)
}

// ---- cast

// cast(x, dtype(x)) → x
fn cast_identity(eg: &EG, n: &GNode) -> Vec<Rhs> {
    on_typed_operand(eg, n, cast::cast_identity)
}

/// Whether every value of `narrow` is exactly representable in `wide`.
fn widens(narrow: DType, wide: DType) -> bool {
    use DType::*;
    matches!(
        (narrow, wide),
        (BF16, F32) | (BF16, F64) | (F32, F64) | (I32, I64)
    )
}

// cast(cast(x, wide), dtype(x)) → x   when `wide` represents every value of dtype(x)
fn cast_roundtrip(eg: &EG, n: &GNode) -> Vec<Rhs> {
    let Some((Op::Cast { dtype: back }, [x])) = parts(n) else {
        return vec![];
    };
    ops_in(eg, *x)
        .filter_map(|(op, kids)| match (op, kids.as_slice()) {
            (Op::Cast { dtype: wide }, [src]) => {
                let orig = eg[*src].data.tensor()?.dtype;
                (orig == back && widens(orig, wide)).then_some(Rhs::Class(*src))
            }
            _ => None,
        })
        .collect()
}

// ---- constants

/// `x op full(c)` where the constant has x's shape and dtype: (x, c, dtype).
fn with_constant(eg: &EG, n: &GNode, name: &str) -> Option<(Id, f64, DType)> {
    let (op, kids) = parts(n)?;
    match (op.name() == name, kids) {
        (true, [x, c]) => {
            let (value, dtype) = constant(eg, *c)?;
            dtype.is_float().then_some((*x, value, dtype))
        }
        _ => None,
    }
}

fn exact_in(dtype: DType, v: f64) -> bool {
    round_to_dtype(dtype, v) == v || (v.is_nan() && round_to_dtype(dtype, v).is_nan())
}

fn scaled(x: Id, value: f64) -> Vec<Rhs> {
    vec![Rhs::Node(Op::MulScalar { value }, vec![Rhs::Class(x)])]
}

// x · full(c) → x * c   when c is exact in the dtype
fn mul_full(eg: &EG, n: &GNode) -> Vec<Rhs> {
    // `full` rounds its value to the dtype, `mul_scalar` multiplies by the f64 value: the same
    // product only when the value is exact in the dtype.
    match with_constant(eg, n, "mul") {
        Some((x, c, dtype)) if exact_in(dtype, c) => scaled(x, c),
        _ => vec![],
    }
}

fn is_pow2(c: f64) -> bool {
    c.is_finite() && c != 0.0 && c.abs().log2().fract() == 0.0
}

// x / full(2^k) → x * 2^-k   (both scale the exponent only: exact)
fn div_pow2(eg: &EG, n: &GNode) -> Vec<Rhs> {
    match with_constant(eg, n, "div") {
        Some((x, c, dtype)) if is_pow2(c) && exact_in(dtype, c) && exact_in(dtype, 1.0 / c) => {
            scaled(x, 1.0 / c)
        }
        _ => vec![],
    }
}

// x / full(c) → x * (1/c)   (tier 2: 1/c is rounded)
fn div_const(eg: &EG, n: &GNode) -> Vec<Rhs> {
    match with_constant(eg, n, "div") {
        Some((x, c, dtype)) if !is_pow2(c) && c != 0.0 && exact_in(dtype, c) => scaled(x, 1.0 / c),
        _ => vec![],
    }
}

// ---- reassociation (tier 2)

// (x * a) * b → x * (a·b)   (tier 2: reassociation)
fn scale_chain(eg: &EG, n: &GNode) -> Vec<Rhs> {
    let Some((Op::MulScalar { value: b }, [x])) = parts(n) else {
        return vec![];
    };
    ops_in(eg, *x)
        .filter_map(|(op, kids)| match (op, kids.as_slice()) {
            (Op::MulScalar { value: a }, [src]) => Some(scaled(*src, a * b).remove(0)),
            _ => None,
        })
        .collect()
}

// (x + a) + b → x + (a+b)   (tier 2: reassociation)
fn shift_chain(eg: &EG, n: &GNode) -> Vec<Rhs> {
    let Some((Op::AddScalar { value: b }, [x])) = parts(n) else {
        return vec![];
    };
    ops_in(eg, *x)
        .filter_map(|(op, kids)| match (op, kids.as_slice()) {
            (Op::AddScalar { value: a }, [src]) => Some(Rhs::Node(
                Op::AddScalar { value: a + b },
                vec![Rhs::Class(*src)],
            )),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_rules_parse() {
        let rules = builtin_rules();
        let mut names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate rule names");
        for r in &rules {
            assert!(!r.math.is_empty(), "rule {} has no math comment", r.name);
            r.to_rewrite().unwrap();
        }
    }

    #[test]
    fn tier_one_excludes_the_changing_rules() {
        assert!(rules_for(Tier::Preserving)
            .iter()
            .all(|r| r.tier == Tier::Preserving));
        assert!(rules_for(Tier::Changing)
            .iter()
            .any(|r| r.name == "scale-chain"));
    }

    #[test]
    fn pow2() {
        assert!(is_pow2(0.5) && is_pow2(-4.0) && is_pow2(1.0));
        assert!(!is_pow2(3.0) && !is_pow2(0.0) && !is_pow2(f64::INFINITY));
    }
}
