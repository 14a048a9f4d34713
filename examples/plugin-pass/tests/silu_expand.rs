//! `silu-expand` through graphtrain's snapshot helper, through the registry, and on the real
//! `tiny` Llama 3 train step.

use graphtrain::ir::optim::{build_train_step, OptimConfig};
use graphtrain::ir::{verify, DType, Op, UnaryOp};
use graphtrain::models::Llama3Config;
use graphtrain_passes::testing::{check, compare_numerics};
use graphtrain_passes::{Pass, Tier};
use plugin_pass::{registry, SiluExpand};

#[test]
fn expands_silu_and_keeps_metadata() {
    let out = check(
        &SiluExpand,
        "graph g {
  input %x: f32[2,8]
  input %u: f32[2,8]
  %2: f32[2,8] = silu(%x)  # fwd layers.0.feed_forward region=3
  %3: f32[2,8] = mul(%2, %u)  # fwd layers.0.feed_forward region=3
  %4: f32[2,8] = silu(%3)  # bwd layers.0.feed_forward remat=recompute
  output y = %4
  output s = %2
}",
    );
    insta::assert_snapshot!(out);
}

#[test]
fn graph_without_silu_is_unchanged() {
    let out = check(
        &SiluExpand,
        "graph g {
  input %x: f32[4]
  %1: f32[4] = sigmoid(%x)  # fwd
  output y = %1
}",
    );
    assert!(out.starts_with("// no change"), "{out}");
}

#[test]
fn registry_holds_the_builtins_and_the_plugin() {
    let r = registry();
    for name in ["silu-expand", "cse", "dce", "canonicalize"] {
        assert!(r.names().contains(&name), "{name} missing: {:?}", r.names());
    }
    let info = r.info("silu-expand").expect("registered");
    assert_eq!(info.tier, Tier::Changing);
    assert!(r.build("silu-expand", None).is_ok());
    let err = r
        .build("silu-expand", Some("fast"))
        .err()
        .unwrap_or_default();
    assert!(err.contains("takes no option"), "{err}");
}

#[test]
fn tiny_train_step_stays_within_tier_2_tolerance() {
    let traced = Llama3Config::builtin("tiny")
        .expect("`tiny` is a built-in config")
        .trace(DType::F32)
        .expect("tiny traces");
    let before = build_train_step(traced, "loss", &OptimConfig::default())
        .expect("tiny builds a train step")
        .graph;
    let (after, report) = SiluExpand.run(&before).expect("the pass runs");
    verify(&after).expect("the output verifies");
    compare_numerics(&before, &after, SiluExpand.tier(), 2).expect("within tolerance");
    let silu = |n: &&graphtrain::ir::Node| matches!(n.op, Op::Unary(UnaryOp::Silu));
    let expanded = before.nodes.iter().filter(silu).count();
    assert_eq!(expanded, 2, "one silu per layer in `tiny`: {report}");
    assert_eq!(after.nodes.iter().filter(silu).count(), 0);
    assert_eq!(after.nodes.len(), before.nodes.len() + expanded);
}
