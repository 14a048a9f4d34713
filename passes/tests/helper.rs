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

/// A pass that leaves an ill-typed graph: the pipeline's verifier must name it.
struct Breaker;

impl Pass for Breaker {
    fn name(&self) -> &str {
        "breaker"
    }
    fn tier(&self) -> Tier {
        Tier::Preserving
    }
    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut out = g.clone();
        // Declares an output type the op cannot produce.
        let v = out.nodes[0].outputs[0];
        out.values[v.index()] = graphtrain_ir::TensorType::new(graphtrain_ir::DType::F64, [8]);
        Ok((out, PassReport::default()))
    }
}

#[test]
fn the_pipeline_names_the_pass_that_broke_the_graph() {
    let g = graphtrain_ir::text::parse(INPUT).unwrap();
    let registry = graphtrain_passes::Registry::builtin();
    let mut pipeline = graphtrain_passes::Pipeline::new(vec![
        registry.build("cse", None).unwrap(),
        Box::new(Breaker),
        registry.build("dce", None).unwrap(),
    ]);
    pipeline.verify_each = true;
    let err = pipeline
        .run(&g)
        .expect_err("the broken graph is caught")
        .to_string();
    assert!(err.starts_with("pass 2 (`breaker`)"), "{err}");
    assert!(err.contains("declared f64[8]"), "{err}");
}
