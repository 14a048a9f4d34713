//! `dce`: dead-code elimination.
//!
//! Changes: removes every node none of whose outputs is needed, transitively, by a graph output.
//! Guarantees: tier 1; surviving nodes keep their order, ops and metadata. Every op in the IR is
//! pure (random ops are keyed by a seed input), so removing an unused node never changes a result.
//! Declines: never; a graph without dead nodes is returned unchanged.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::substitute::{op_counts, rebuild, Substitution};
use graphtrain_ir::{Graph, ValueId};

pub const INFO: PassInfo = PassInfo {
    name: "dce",
    tier: Tier::Preserving,
    summary: "remove nodes whose results no output needs",
    contract:
        "Removes every node none of whose outputs is needed, transitively, by a graph output. \
Tier 1: surviving nodes keep their order, ops and metadata, and since every op is pure (random ops \
are keyed by a seed input) results are unchanged. Never declines.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(Dce)));
}

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let targets: Vec<ValueId> = g.outputs.iter().map(|o| o.value).collect();
        let keep = g.needed_for(&targets);
        let dead = keep.iter().filter(|k| !**k).count();
        let mut report = PassReport::default();
        if dead == 0 {
            return Ok((g.clone(), report));
        }
        report.change(format!(
            "removed {dead} dead node(s): {}",
            op_counts(g, |i| !keep[i])
        ));
        let out = rebuild(g, g.nodes.clone(), &keep, &Substitution::new(g));
        Ok((out, report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    #[test]
    fn removes_unused_chains_and_keeps_the_rest() {
        let out = check(
            &Dce,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd a
  %2: f32[4] = log(%1)  # fwd dead
  %3: f32[4] = neg(%2)  # fwd dead
  %4: f32[4] = mul(%1, %1)  # fwd b
  output y = %4
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn nothing_dead_means_no_change() {
        let out = check(
            &Dce,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd
  output y = %1
}",
        );
        assert!(out.starts_with("// no change"), "{out}");
    }
}
