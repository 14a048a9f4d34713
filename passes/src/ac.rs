//! `ac`: activation checkpointing = `ac_policy` (tag) then `remat` (act).
//!
//! Changes: tags every forward node `remat=save|recompute` under the policy in the option
//! (`full`, `selective` (default), `names:PAT1;PAT2`, `budget:F`; see `ac_policy`), then emits the
//! recompute copies in backward (see `remat`). Forward nodes keep their order and ops; backward
//! readers of recomputed values read the copies.
//!
//! Guarantees: tier 1 (recomputed ops are pure and deterministic, so results are bitwise
//! unchanged). The report gives saved activation bytes before/after, recompute FLOPs, predicted
//! peak device bytes before/after (`memory::profile`) and, for `budget:F`, the achieved point.
//!
//! Declines: as `ac_policy` (no forward node inside a transformer layer; a budget below what
//! saving only layer inputs reaches, then acting like `full`) and as `remat` (recompute-tagged
//! graph outputs stay saved).

use crate::ac_policy::{self, Policy, OPTION_HELP};
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::remat::{plan_from_tags, rematerialize};
use graphtrain_ir::Graph;

pub const INFO: PassInfo = PassInfo {
    name: "ac",
    tier: Tier::Preserving,
    summary: "activation checkpointing: tag by a policy (ac_policy), then recompute (remat)",
    contract: "Runs ac_policy with the given policy (full, selective (default), names:PAT;.., \
budget:F), then remat: forward values tagged recompute are recomputed in backward right before \
their first reader instead of being saved. Tier 1: recomputed ops are pure and deterministic. \
Reports saved activation bytes and predicted peak before/after, recompute FLOPs, and for budget:F \
the achieved fraction. Declines as ac_policy and remat do.",
    option_help: Some(OPTION_HELP),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |opt| {
        Ok(Box::new(Ac {
            policy: Policy::parse(opt)?,
        }))
    });
}

pub struct Ac {
    pub policy: Policy,
}

impl Pass for Ac {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let tagged = ac_policy::tag(g, &self.policy, &mut report);
        let plan = plan_from_tags(&tagged);
        let (out, copies) = rematerialize(&tagged, &plan, &mut report);
        if copies == 0 {
            // Tags alone are still a change worth keeping (they document the decision).
            return Ok((tagged, report));
        }
        Ok((out, report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    fn ac(opt: &str) -> Ac {
        Ac {
            policy: Policy::parse(Some(opt)).unwrap(),
        }
    }

    #[test]
    fn full_recomputes_each_layer_from_its_input() {
        insta::assert_snapshot!(check(&ac("full"), crate::ac_policy::tests::TWO_LAYERS));
    }

    #[test]
    fn selective_recomputes_pointwise_ops() {
        insta::assert_snapshot!(check(&ac("selective"), crate::ac_policy::tests::TWO_LAYERS));
    }

    #[test]
    fn budget_reports_the_achieved_fraction() {
        let out = check(&ac("budget:0.5"), crate::ac_policy::tests::TWO_LAYERS);
        assert!(out.contains("budget_fraction_of_budget"), "{out}");
        assert!(out.contains("recompute_flops"), "{out}");
    }

    #[test]
    fn default_policy_is_selective() {
        let r = Registry::builtin();
        assert!(r.build("ac", None).is_ok());
        let e = r.build("ac", Some("budget:2")).err().unwrap_or_default();
        assert!(e.contains("(0, 1]") && e.contains("accepted:"), "{e}");
    }
}
