//! A train step split into micro-batches (`graphtrain_ir::micro_batches`) against the unsplit
//! step on the same batch: the same loss, gradient norm and update up to f64 rounding; one
//! micro-batch's activations live at a time; and every built-in pass either keeps the split
//! step's numbers and schedule or declines.

use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::{interp, verify, DType, Graph, HostTensor};
use graphtrain_models::Llama3Config;
use graphtrain_passes::memory::profile;
use graphtrain_passes::testing::{compare_numerics, random_inputs};
use graphtrain_passes::{Registry, Tier};

/// `tiny` at `batch` rows, its forward traced at `batch / micro_batches` rows.
fn step(batch: usize, micro_batches: u32, dtype: DType) -> Graph {
    let model = Llama3Config {
        batch: batch / micro_batches as usize,
        ..Llama3Config::builtin("tiny").expect("`tiny` is a built-in config")
    };
    let traced = model.trace(dtype).expect("tiny traces");
    let cfg = OptimConfig {
        micro_batches,
        ..OptimConfig::default()
    };
    let step = build_train_step(traced, "loss", &cfg).expect("tiny builds a train step");
    verify(&step.graph).expect("the step verifies");
    step.graph
}

#[test]
fn a_split_step_computes_the_unsplit_steps_update() {
    let whole = step(4, 1, DType::F64);
    for n in [2, 4] {
        let split = step(4, n, DType::F64);
        assert_eq!(split.micro_batches(), n);
        let names = |g: &Graph| -> Vec<(String, usize)> {
            let numel = |v| g.ty(v).numel();
            g.inputs
                .iter()
                .map(|i| (i.name.clone(), numel(i.value)))
                .collect()
        };
        assert_eq!(
            names(&split),
            names(&whole),
            "the same inputs, the whole batch"
        );
        let inputs = random_inputs(&whole, 7);
        // The same elements: the batch `[4, seq]` as `[4 / n, n, seq]`.
        let split_inputs: Vec<HostTensor> = inputs
            .iter()
            .zip(&split.inputs)
            .map(|(t, input)| HostTensor::new(split.ty(input.value).clone(), t.data.clone()))
            .collect::<Result<_, _>>()
            .expect("the same number of elements");
        let want = interp::run(&whole, &inputs).expect("the unsplit step runs");
        let got = interp::run(&split, &split_inputs).expect("the split step runs");
        assert_eq!(got.outputs.len(), want.outputs.len());
        for (k, output) in whole.outputs.iter().enumerate() {
            let (a, b) = (&got.outputs[k].data, &want.outputs[k].data);
            let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
            let worst = a.iter().zip(b).fold(0f64, |m, (x, y)| {
                // NaN on either side is a failure, never "equal".
                let d = if x.is_finite() && y.is_finite() {
                    (x - y).abs()
                } else {
                    f64::INFINITY
                };
                m.max(d)
            });
            assert!(
                worst <= 1e-12 * scale,
                "{n} micro-batches: output `{}` differs by {worst:e} (scale {scale:e})",
                output.name
            );
        }
    }
}

#[test]
fn one_micro_batchs_activations_are_live_at_a_time() {
    let whole = profile(&step(8, 1, DType::F32));
    let split = profile(&step(8, 4, DType::F32));
    let fixed = whole.param_bytes + whole.state_bytes + whole.input_bytes;
    let (whole_work, split_work) = (whole.peak_bytes - fixed, split.peak_bytes - fixed);
    println!("peak beyond parameters, state and batch: {whole_work} whole, {split_work} in 4");
    assert!(
        split_work * 2 < whole_work,
        "peak beyond parameters, state and batch: {split_work} split in 4, {whole_work} whole"
    );
}

/// Passes that need an option to build, with one that applies to a single-device step.
const OPTIONS: &[(&str, &str)] = &[
    ("schedule", "memory:1000000000"),
    (
        "rewrite",
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/rules/layout.rules"),
    ),
];

/// Passes that act only on what another pass tagged, or only with an option: run after it.
const SEQUENCES: &[&[(&str, Option<&str>)]] = &[
    &[("ac_policy", Some("full")), ("remat", None)],
    &[("ac_policy", Some("selective")), ("remat", None)],
    &[("offload", Some("min_bytes:1024;prefetch:2"))],
    &[("cse", None), ("egraph", None), ("merge_matmuls", None)],
];

#[test]
fn every_pass_keeps_a_split_steps_numbers_or_declines() {
    let before = step(4, 2, DType::F32);
    let registry = Registry::builtin();
    let singles: Vec<Vec<(&str, Option<&str>)>> = registry
        .names()
        .into_iter()
        .map(|name| {
            let option = OPTIONS.iter().find(|(n, _)| *n == name).map(|(_, o)| *o);
            vec![(name, option)]
        })
        .collect();
    let mut failures = Vec::new();
    let mut changed = 0;
    for pipeline in singles
        .iter()
        .map(Vec::as_slice)
        .chain(SEQUENCES.iter().copied())
    {
        let shown: Vec<String> = pipeline
            .iter()
            .map(|(n, o)| o.map_or(n.to_string(), |o| format!("{n}={o}")))
            .collect();
        let shown = shown.join(",");
        let mut after = before.clone();
        let mut tier = Tier::Preserving;
        let mut changes = 0;
        for (name, option) in pipeline {
            let pass = registry.build(name, *option).expect("the pass builds");
            if pass.tier() == Tier::Changing {
                tier = Tier::Changing;
            }
            match pass.run(&after) {
                Ok((g, report)) => {
                    println!(
                        "{shown}: {name}: {} change(s), {} decline(s){}",
                        report.changes.len(),
                        report.declined.len(),
                        report
                            .declined
                            .first()
                            .map(|d| format!(": {}", d.reason))
                            .unwrap_or_default()
                    );
                    changes += report.changes.len();
                    after = g;
                }
                Err(e) => failures.push(format!("{shown}: {name} fails: {e}")),
            }
        }
        if changes > 0 {
            changed += 1;
        }
        if let Err(e) = verify(&after) {
            failures.push(format!("{shown}: the result does not verify: {e}"));
            continue;
        }
        if after.micro_batches() != 2 {
            failures.push(format!(
                "{shown}: the result has {} micro-batches",
                after.micro_batches()
            ));
        }
        if let Err(e) = compare_numerics(&before, &after, tier, 2) {
            failures.push(format!("{shown}: numerics: {e}"));
        }
    }
    assert!(changed >= 10, "only {changed} pipelines changed the step");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
