//! `canonicalize`: removes layout no-ops and folds layout chains.
//!
//! Rules, each directional (left becomes right):
//! - reshape(x, shape(x))              → x
//! - reshape(reshape(x, s1), s2)       → reshape(x, s2)
//! - transpose(x, identity)            → x
//! - transpose(transpose(x, p), q)     → transpose(x, p∘q), where (p∘q)[j] = p[q[j]]; → x if identity
//! - expand(x, shape(x))               → x
//! - slice(x, a, 0, dim_a(x))          → x
//! - concat(x)                         → x
//! - cast(x, dtype(x))                 → x
//! - mul_scalar(x, 1.0)                → x              (x·1 = x exactly)
//! - add_scalar(x, -0.0)               → x              (x + -0 = x exactly; x + +0 is not: -0 + 0 = +0)
//!
//! The rules' conditions and results live in `crate::rules`, which `egraph` draws on too; this
//! file walks the graph and applies them.
//!
//! Guarantees: tier 1 (layout ops move elements without arithmetic; the two scalar rules are exact
//! in IEEE arithmetic). Inner nodes of folded chains are left for `dce` when nothing else reads
//! them. Declines to fold a chain from a backward recompute copy (`remat=recompute`, made by
//! activation checkpointing) into a forward node: the copy would then read a forward value from
//! backward and undo the memory saving.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::rules::{cast, layout, scalar, Outcome};
use crate::substitute::{is_recompute_copy, rebuild, Substitution};
use graphtrain_ir::{Graph, Node, Op, ValueId};

pub const INFO: PassInfo = PassInfo {
    name: "canonicalize",
    tier: Tier::Preserving,
    summary: "drop identity reshapes/transposes/casts, fold reshape and transpose chains",
    contract:
        "Directional rules: identity reshape, transpose, expand, slice, single-input concat, \
same-dtype cast, mul_scalar(1.0) and add_scalar(-0.0) become their input; reshape(reshape(x)) and \
transpose(transpose(x)) fold into one op (or none). Tier 1: layout ops do no arithmetic and the \
scalar rules are exact in IEEE arithmetic. Inner nodes of a folded chain are left for `dce`. Never \
declines.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(Canonicalize)));
}

pub struct Canonicalize;

/// The first rule that applies to `n` (its operands already substituted), in the order the
/// contract lists them; the rules themselves are in `crate::rules`.
fn rule(
    g: &Graph,
    producer: &[Option<usize>],
    nodes: &[Node],
    n: &Node,
) -> Option<Outcome<ValueId>> {
    let op = &n.op;
    let x = *n.inputs.first()?;
    let xt = g.ty(x);
    // A recompute copy (activation checkpointing) that folded through a forward node would read
    // that node's forward operand from backward and keep it alive: fold only among copies.
    let inner = producer[x.index()]
        .map(|i| &nodes[i])
        .filter(|m| !is_recompute_copy(n) || is_recompute_copy(m));
    let chain = |rule: fn(&Op, &Op, ValueId) -> Option<Outcome<ValueId>>| {
        inner.and_then(|m| rule(op, &m.op, *m.inputs.first()?))
    };
    layout::reshape_identity(op, x, xt)
        .or_else(|| chain(layout::reshape_chain))
        .or_else(|| layout::transpose_identity(op, x))
        .or_else(|| chain(layout::transpose_pair))
        .or_else(|| layout::expand_identity(op, x, xt))
        .or_else(|| layout::slice_full(op, x, xt))
        .or_else(|| layout::concat_single(op, &n.inputs))
        .or_else(|| cast::cast_identity(op, x, xt))
        .or_else(|| scalar::mul_one(op, x))
        .or_else(|| scalar::add_neg_zero(op, x))
}

impl Pass for Canonicalize {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let producer = g.producers();
        let mut subst = Substitution::new(g);
        let mut nodes = g.nodes.clone();
        let mut keep = vec![true; nodes.len()];
        let (mut forwarded, mut folded) = (0usize, 0usize);
        for i in 0..nodes.len() {
            let mut n = nodes[i].clone();
            for v in &mut n.inputs {
                *v = subst.get(*v);
            }
            match rule(g, &producer, &nodes, &n) {
                Some(Outcome::Forward(v)) => {
                    subst.set(n.outputs[0], v);
                    keep[i] = false;
                    forwarded += 1;
                }
                Some(Outcome::Replace(op, v)) => {
                    n.op = op;
                    n.inputs = vec![v];
                    folded += 1;
                }
                None => {}
            }
            nodes[i] = n;
        }
        let mut report = PassReport::default();
        if forwarded + folded == 0 {
            return Ok((g.clone(), report));
        }
        if forwarded > 0 {
            report.change(format!("removed {forwarded} identity op(s)"));
        }
        if folded > 0 {
            report.change(format!("folded {folded} reshape/transpose chain(s)"));
        }
        Ok((rebuild(g, nodes, &keep, &subst), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    #[test]
    fn identities_and_chains() {
        let out = check(
            &Canonicalize,
            "graph g {
  param %w: f32[3,4]
  input %x: f32[2,3,4]
  %2: f32[4,3] = transpose(%w, perm=[1,0])  # fwd output
  %3: f32[6,4] = reshape(%x, shape=[6,4])  # fwd
  %4: f32[24] = reshape(%3, shape=[24])  # fwd
  %5: f32[4,2,3] = transpose(%x, perm=[2,0,1])  # fwd
  %6: f32[2,3,4] = transpose(%5, perm=[1,2,0])  # fwd
  %7: f32[3,2,4] = transpose(%5, perm=[2,1,0])  # fwd
  %8: f32[2,3,4] = slice(%6, axis=1, start=0, end=3)  # fwd
  %9: f32[3,4] = transpose(%2, perm=[1,0])  # bwd output
  %10: f32[3,4] = mul_scalar(%9, value=1.0)  # bwd
  %11: f32[3,4] = add_scalar(%10, value=-0.0)  # bwd
  %12: f32[3,4] = cast(%11, dtype=f32)  # bwd
  output a = %12
  output b = %4
  output c = %7
  output d = %8
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn recompute_copies_do_not_fold_into_forward_chains() {
        let out = check(
            &Canonicalize,
            "graph g {
  input %x: f32[2,3]
  %1: f32[3,2] = transpose(%x, perm=[1,0])  # fwd remat=recompute
  %2: f32[3,2] = exp(%1)  # fwd
  %3: f32[3,2] = transpose(%x, perm=[1,0])  # bwd remat=recompute
  %4: f32[2,3] = transpose(%3, perm=[1,0])  # bwd remat=recompute
  %5: f32[2,3] = transpose(%1, perm=[1,0])  # bwd remat=recompute
  output y = %2
  output a = %4
  output b = %5
}",
        );
        // The copy-of-copy pair cancels; the copy reading the forward %1 stays as it is.
        assert!(out.contains("output a = %x"), "{out}");
        assert!(out.contains("transpose(%1, perm=[1,0])  # bwd"), "{out}");
    }

    #[test]
    fn plus_zero_is_kept() {
        // -0.0 + 0.0 = +0.0, so this is not an identity.
        let out = check(
            &Canonicalize,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = add_scalar(%x, value=0.0)  # fwd
  output y = %1
}",
        );
        assert!(out.starts_with("// no change"), "{out}");
    }
}
