//! The snapshot-test helper cannot bless a wrong rewrite: a fixture pass that claims tier 1 but
//! turns `add` into `sub` is caught by the numerics check, and so is a tier-2 pass whose error
//! exceeds the tolerance.

use graphtrain_ir::{BinaryOp, Graph, Op};
use graphtrain_passes::testing::try_check;
use graphtrain_passes::{Pass, PassError, PassReport, Tier};

struct Rewrite {
    tier: Tier,
    to: Op,
}

impl Pass for Rewrite {
    fn name(&self) -> &str {
        "wrong-rewrite"
    }
    fn tier(&self) -> Tier {
        self.tier
    }
    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut out = g.clone();
        for n in &mut out.nodes {
            if n.op == Op::Binary(BinaryOp::Add) {
                n.op = self.to.clone();
            }
        }
        let mut r = PassReport::default();
        r.change("rewrote add");
        Ok((out, r))
    }
}

const INPUT: &str = "graph g {
  input %x: f32[8]
  input %y: f32[8]
  %2: f32[8] = add(%x, %y)  # fwd
  output z = %2
}";

#[test]
fn a_wrong_tier1_rewrite_is_caught() {
    let pass = Rewrite {
        tier: Tier::Preserving,
        to: Op::Binary(BinaryOp::Sub),
    };
    let err = try_check(&pass, INPUT).unwrap_err().to_string();
    assert!(
        err.contains("changed the numbers") && err.contains("output `z`"),
        "{err}"
    );
}

#[test]
fn a_wrong_tier2_rewrite_is_caught_too() {
    let pass = Rewrite {
        tier: Tier::Changing,
        to: Op::Binary(BinaryOp::Max),
    };
    assert!(try_check(&pass, INPUT).is_err());
}

#[test]
fn a_correct_rewrite_passes() {
    let pass = Rewrite {
        tier: Tier::Preserving,
        to: Op::Binary(BinaryOp::Add),
    };
    assert!(try_check(&pass, INPUT)
        .unwrap()
        .text
        .contains("add(%x, %y)"));
}
