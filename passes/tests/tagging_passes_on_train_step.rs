//! The tagging pass `capture` on the real `tiny` Llama 3 train step: its output verifies,
//! computes bitwise the same numbers on the reference interpreter, and carries valid tags.

use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::{verify, DType, Graph};
use graphtrain_models::Llama3Config;
use graphtrain_passes::capture::Capture;
use graphtrain_passes::testing::compare_numerics;
use graphtrain_passes::{Pass, PassReport, Tier};

fn tiny_train_step() -> Graph {
    let traced = Llama3Config::builtin("tiny")
        .expect("`tiny` is a built-in config")
        .trace(DType::F32)
        .expect("tiny traces");
    build_train_step(traced, "loss", &OptimConfig::default())
        .expect("tiny builds a train step")
        .graph
}

/// Runs `pass`, checks the output verifies and is bitwise identical, and that only tags changed.
fn run_checked(pass: &dyn Pass, before: &Graph) -> (Graph, PassReport) {
    let (after, report) = pass.run(before).expect("the pass runs");
    verify(&after).expect("the output verifies");
    compare_numerics(before, &after, Tier::Preserving, 2).expect("bitwise identical");
    assert_eq!(before.nodes.len(), after.nodes.len());
    for (a, b) in before.nodes.iter().zip(&after.nodes) {
        assert_eq!(
            (&a.op, &a.inputs, &a.outputs),
            (&b.op, &b.inputs, &b.outputs)
        );
        assert_eq!(
            (&a.meta.module, a.meta.phase),
            (&b.meta.module, b.meta.phase)
        );
    }
    (after, report)
}

fn metric(report: &PassReport, name: &str) -> f64 {
    report
        .metrics
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("metric `{name}` missing"))
}

#[test]
fn capture_on_the_tiny_train_step() {
    let before = tiny_train_step();
    let (after, report) = run_checked(&Capture::default(), &before);
    let regions = metric(&report, "capture_regions") as usize;
    println!(
        "capture: {regions} region(s), {} captured, {} uncaptured",
        metric(&report, "captured_nodes"),
        metric(&report, "uncaptured_nodes")
    );
    // No host transfers in the plain step: one region holds everything.
    assert_eq!(regions, 1, "{report}");
    assert!(after.nodes.iter().all(|n| n.meta.tags.region == Some(0)));

    // Excluding the optimizer's grad-norm leaves the step before it and the updates after it.
    let pass = Capture::from_option(Some("exclude:optim.clip_grad_norm")).expect("valid option");
    let (after, report) = run_checked(&pass, &before);
    println!(
        "capture exclude:optim.clip_grad_norm: {} region(s), {} decline(s)",
        metric(&report, "capture_regions"),
        report.declined.len()
    );
    assert_eq!(metric(&report, "capture_regions"), 2.0, "{report}");
    for n in &after.nodes {
        let excluded = n.meta.module == "optim.clip_grad_norm";
        assert_eq!(n.meta.tags.region.is_none(), excluded, "{}", n.meta.module);
    }
}
