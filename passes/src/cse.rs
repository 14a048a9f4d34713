//! `cse`: common-subexpression elimination.
//!
//! Changes: a node with the same op, attributes and (already deduplicated) operands as an earlier
//! node is removed, and its uses read the earlier node's outputs.
//! Guarantees: tier 1; ops are pure and deterministic, so the earlier result is bitwise the one
//! the duplicate would compute. The earlier node keeps its own metadata.
//! Declines: a backward node tagged `remat=recompute` is a deliberate copy made by activation
//! checkpointing to shorten a forward value's lifetime; merging it back into the forward original
//! would undo that, so such copies only merge with each other. Likewise nodes of different
//! micro-batches (`micro_batches.rs`) are not merged: the survivor would stay live from one
//! micro-batch to the next, the memory a split step exists to save (a weight's transposes and
//! casts are computed again in each micro-batch instead; on `peer`, 32 rows in four, merging
//! them held 15 MiB more in `trace`'s plan, 2 MiB on `cpu`, which reads most transposes in
//! place). Otherwise CSE can lengthen a value's lifetime (a forward value reused in
//! backward), which memory passes account for.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::substitute::{is_recompute_copy, op_counts, rebuild, Substitution};
use graphtrain_ir::{Graph, ValueId};
use std::collections::HashMap;

pub const INFO: PassInfo = PassInfo {
    name: "cse",
    tier: Tier::Preserving,
    summary: "merge nodes that compute the same op on the same operands",
    contract:
        "A node with the same op, attributes and operands as an earlier node is removed and its \
uses read the earlier outputs. Tier 1: ops are pure and deterministic, so results are bitwise \
unchanged; the surviving node keeps its metadata. Never merges nodes of different micro-batches; \
may lengthen the lifetime of a reused value.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(Cse)));
}

pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut subst = Substitution::new(g);
        type Key = (String, Vec<ValueId>, bool, Option<u32>);
        let mut seen: HashMap<Key, usize> = HashMap::new();
        let mut keep = vec![true; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            let operands: Vec<ValueId> = n.inputs.iter().map(|v| subst.get(*v)).collect();
            // `Debug` of an op spells every attribute, floats exactly.
            let recompute_copy = is_recompute_copy(n);
            let key = (
                format!("{:?}", n.op),
                operands,
                recompute_copy,
                n.meta.micro_batch,
            );
            match seen.get(&key) {
                Some(&first) => {
                    keep[i] = false;
                    for (dup, orig) in n.outputs.iter().zip(&g.nodes[first].outputs) {
                        subst.set(*dup, *orig);
                    }
                }
                None => {
                    seen.insert(key, i);
                }
            }
        }
        let merged = keep.iter().filter(|k| !**k).count();
        let mut report = PassReport::default();
        if merged == 0 {
            return Ok((g.clone(), report));
        }
        report.change(format!(
            "merged {merged} duplicate node(s): {}",
            op_counts(g, |i| !keep[i])
        ));
        Ok((rebuild(g, g.nodes.clone(), &keep, &subst), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    #[test]
    fn merges_duplicates_transitively() {
        let out = check(
            &Cse,
            "graph g {
  param %w: f32[3,4]
  input %x: f32[2,3]
  %2: f32[4,3] = transpose(%w, perm=[1,0])  # fwd layers.0.wq
  %3: f32[4,3] = transpose(%w, perm=[1,0])  # bwd layers.0.wq
  %4: f32[3,4] = transpose(%2, perm=[1,0])  # bwd a
  %5: f32[3,4] = transpose(%3, perm=[1,0])  # bwd b
  %6: f32[3,4] = add(%4, %5)  # bwd
  %7: f32[3,4] = add(%4, %w)  # bwd
  output y = %6
  output z = %7
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn recompute_copies_are_not_merged_into_forward_originals() {
        let out = check(
            &Cse,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd remat=recompute
  %2: f32[4] = exp(%x)  # bwd remat=recompute
  %3: f32[4] = exp(%x)  # bwd remat=recompute
  %4: f32[4] = add(%2, %3)  # bwd
  output y = %1
  output z = %4
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn different_attributes_are_not_merged() {
        let out = check(
            &Cse,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = mul_scalar(%x, value=2.0)  # fwd
  %2: f32[4] = mul_scalar(%x, value=2.0000000000000004)  # fwd
  %3: f32[4] = add(%1, %2)  # fwd
  output y = %3
}",
        );
        assert!(out.starts_with("// no change"), "{out}");
    }
}
