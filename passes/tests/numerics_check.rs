//! The numerics check cannot be fooled by non-finite numbers, by a changed shape, by tensors of a
//! small scale, or by a wrong optimizer update on a whole train step:
//! - a NaN or an infinity on either side fails, even the same NaN on both sides;
//! - a different element count or output list fails;
//! - tier 2 holds a tensor of magnitude 1e-8 to its own scale (a 1% error fails);
//! - `random_inputs` gives the `tiny` train step a valid training state, so a pass that flips
//!   an AdamW hyperparameter or the sign of the gradients fails `compare_numerics`; with the
//!   old N(0, 1) inputs (`step` near -1 on seed 0) every parameter update was NaN on both sides
//!   and counted as equal.

use graphtrain_ir::interp::{run, HostTensor};
use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::ValueId;
use graphtrain_ir::{rng, text, verify, DType, Graph, InputKind, Node, Op, TensorType, UnaryOp};
use graphtrain_models::Llama3Config;
use graphtrain_passes::testing::{
    compare_numerics, compare_numerics_counted, compare_tensors, random_inputs, try_check,
};
use graphtrain_passes::{Pass, PassError, PassReport, Tier};

/// A fixture pass: applies `edit` to a copy of the graph and claims `tier`.
struct Edit<F: Fn(&mut Graph)> {
    tier: Tier,
    edit: F,
}

impl<F: Fn(&mut Graph)> Pass for Edit<F> {
    fn name(&self) -> &str {
        "wrong-edit"
    }
    fn tier(&self) -> Tier {
        self.tier
    }
    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut out = g.clone();
        (self.edit)(&mut out);
        let mut r = PassReport::default();
        r.change("edited the graph");
        Ok((out, r))
    }
}

fn edit<F: Fn(&mut Graph)>(tier: Tier, edit: F) -> Edit<F> {
    Edit { tier, edit }
}

fn both_tiers() -> [Tier; 2] {
    [Tier::Preserving, Tier::Changing]
}

fn f32s(data: &[f64]) -> HostTensor {
    HostTensor::new(TensorType::new(DType::F32, [data.len()]), data.to_vec()).unwrap()
}

// ---- non-finite values ----

#[test]
fn nan_on_one_side_fails() {
    // `neg` becomes `sqrt`: NaN wherever x < 0 (about half of N(0, 1)).
    let src = "graph g {
  input %x: f32[16]
  %1: f32[16] = neg(%x)  # fwd
  output y = %1
}";
    for tier in both_tiers() {
        let pass = edit(tier, |g| g.nodes[0].op = Op::Unary(UnaryOp::Sqrt));
        let err = try_check(&pass, src).unwrap_err().to_string();
        assert!(
            err.contains("output `y` element") && err.contains("is not finite"),
            "{err}"
        );
        assert!(err.contains("NaN after"), "{err}");
    }
    let err = compare_tensors(
        "t",
        &f32s(&[1.0, 2.0]),
        &f32s(&[1.0, f64::NAN]),
        Tier::Changing,
    )
    .unwrap_err();
    assert!(
        err.contains("output `t` element 1 at [1] is not finite: 2e0 before, NaN after"),
        "{err}"
    );
}

#[test]
fn nan_on_both_sides_fails() {
    // log(-exp(x)) is NaN everywhere, before and after a pass that changes nothing.
    let src = "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd
  %2: f32[4] = neg(%1)  # fwd
  %3: f32[4] = log(%2)  # fwd
  output y = %3
}";
    for tier in both_tiers() {
        let err = try_check(&edit(tier, |_| {}), src).unwrap_err().to_string();
        assert!(
            err.contains("output `y` element 0 at [0] is not finite: NaN before, NaN after"),
            "{err}"
        );
    }
    let nan = f32s(&[f64::NAN]);
    for tier in both_tiers() {
        assert!(compare_tensors("t", &nan, &nan, tier).is_err());
    }
}

#[test]
fn inf_fails() {
    // exp(1000 x) overflows f32 for every x > 0.09: +inf on both sides.
    let src = "graph g {
  input %x: f32[8]
  %1: f32[8] = mul_scalar(%x, value=1000.0)  # fwd
  %2: f32[8] = exp(%1)  # fwd
  output y = %2
}";
    for tier in both_tiers() {
        let err = try_check(&edit(tier, |_| {}), src).unwrap_err().to_string();
        assert!(
            err.contains("output `y` element") && err.contains("inf before, inf after"),
            "{err}"
        );
    }
    for (a, b) in [
        (f64::INFINITY, f64::INFINITY),
        (f64::NEG_INFINITY, f64::NEG_INFINITY),
        (1.0, f64::INFINITY),
        (f64::INFINITY, 1.0),
    ] {
        for tier in both_tiers() {
            let err = compare_tensors("t", &f32s(&[0.5, a]), &f32s(&[0.5, b]), tier).unwrap_err();
            assert!(err.contains("element 1 at [1] is not finite"), "{err}");
        }
    }
}

// ---- shapes and outputs ----

#[test]
fn a_different_element_count_fails() {
    let four = f32s(&[1.0, 2.0, 3.0, 4.0]);
    let five = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    let err = compare_tensors("t", &four, &five, Tier::Changing).unwrap_err();
    assert!(
        err.contains("output `t` changed type: f32[4] -> f32[5]"),
        "{err}"
    );
    // A tensor whose data disagrees with its type (the fields are public).
    let short = HostTensor {
        ty: four.ty.clone(),
        data: vec![1.0, 2.0, 3.0],
    };
    for tier in both_tiers() {
        let err = compare_tensors("t", &four, &short, tier).unwrap_err();
        assert!(err.contains("has 4 elements before and 3 after"), "{err}");
        let err = compare_tensors("t", &short, &four, tier).unwrap_err();
        assert!(err.contains("has 3 elements before and 4 after"), "{err}");
    }

    // In a graph: a pass that points output `y` at a value of another shape.
    let src = "graph g {
  input %x: f32[4]
  input %w: f32[6]
  %2: f32[4] = neg(%x)  # fwd
  %3: f32[6] = neg(%w)  # fwd
  output y = %2
  output z = %3
}";
    let pass = edit(Tier::Changing, |g| g.outputs[0].value = g.outputs[1].value);
    let err = try_check(&pass, src).unwrap_err().to_string();
    assert!(
        err.contains("output `y` changed type: f32[4] -> f32[6]"),
        "{err}"
    );

    // A pass that drops an output.
    let pass = edit(Tier::Preserving, |g| {
        g.outputs.pop();
    });
    let err = try_check(&pass, src).unwrap_err().to_string();
    assert!(err.contains("the outputs changed: 2"), "{err}");
}

// ---- tier-2 scale ----

const TINY_SCALE: &str = "graph g {
  input %x: f32[64]
  %1: f32[64] = mul_scalar(%x, value=1e-8)  # fwd
  output v = %1
}";

fn rescale(factor: f64) -> Edit<impl Fn(&mut Graph)> {
    edit(Tier::Changing, move |g| {
        g.nodes[0].op = Op::MulScalar {
            value: 1e-8 * factor,
        }
    })
}

#[test]
fn tier2_compares_tiny_tensors_at_their_own_scale() {
    // Values around 1e-8 (AdamW second moments), 1% off: the old absolute floor of 1e-4 let
    // this through; the tensor's own scale does not.
    let err = try_check(&rescale(1.01), TINY_SCALE)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("output `v` element") && err.contains("rms"),
        "{err}"
    );
    // Rounding-sized differences at the same scale still pass.
    try_check(&rescale(1.0 + 1e-6), TINY_SCALE).unwrap();

    let moments: Vec<f64> = (1..=16).map(|i| i as f64 * 1e-9).collect();
    let off: Vec<f64> = moments.iter().map(|m| m * 1.01).collect();
    assert!(compare_tensors("m", &f32s(&moments), &f32s(&off), Tier::Changing).is_err());
    let close: Vec<f64> = moments.iter().map(|m| m * (1.0 + 1e-6)).collect();
    assert_eq!(
        compare_tensors("m", &f32s(&moments), &f32s(&close), Tier::Changing),
        Ok(16)
    );
    // An element near zero is held to the tensor's scale, not to its own magnitude.
    assert_eq!(
        compare_tensors(
            "m",
            &f32s(&[1.0, 1e-9]),
            &f32s(&[1.0, 2e-9]),
            Tier::Changing
        ),
        Ok(2)
    );
    assert!(compare_tensors(
        "m",
        &f32s(&[1.0, 1e-9]),
        &f32s(&[1.0, 1e-3]),
        Tier::Changing
    )
    .is_err());
}

#[test]
fn failures_name_the_output_the_element_and_both_values() {
    let before = HostTensor::new(TensorType::new(DType::F32, [2, 3]), vec![0.0; 6]).unwrap();
    let mut after = before.clone();
    after.data[4] = 0.5;
    let err = compare_tensors("layers.0.w", &before, &after, Tier::Preserving).unwrap_err();
    assert_eq!(
        err,
        "output `layers.0.w` element 4 at [1, 1] differs: 0e0 before, 5e-1 after"
    );
}

#[test]
fn zero_trials_compare_nothing_and_fail() {
    let g = text::parse(TINY_SCALE).unwrap();
    assert!(compare_numerics(&g, &g, Tier::Preserving, 0).is_err());
}

// ---- inputs ----

#[test]
fn graphs_that_are_not_train_steps_get_the_inputs_they_always_got() {
    let g = text::parse(
        "graph g {
  input %x: f32[5]
  input %s: f32[3]
  input %i: i32[4]
  %3: f32[3] = sqrt(%s)  # fwd
  output a = %3
  output b = %x
  output c = %i
}",
    )
    .unwrap();
    for seed in 0..3 {
        let inputs = random_inputs(&g, seed);
        for (i, x) in inputs[0].data.iter().enumerate() {
            assert_eq!(*x, rng::normal(seed, 0, i as u64) as f32 as f64);
        }
        for (i, x) in inputs[1].data.iter().enumerate() {
            let want = 0.5 + 1.5 * rng::uniform(seed, 1, i as u64);
            assert_eq!(*x, want as f32 as f64);
        }
        for (i, x) in inputs[2].data.iter().enumerate() {
            assert_eq!(*x, rng::below(seed, 2, i as u64, 4) as f64);
        }
    }
}

#[test]
fn optimizer_operands_are_recognized_by_use_too() {
    // Not named as the train step names them: `adamw`'s operand positions decide.
    let g = text::parse(
        "graph g {
  param %p: f32[64]
  input %g: f32[64]
  state %m: f32[64]
  state %v: f32[64]
  input %rate: f32[]
  input %t: f32[]
  %6: f32[64], %7: f32[64], %8: f32[64] = adamw(%p, %g, %m, %v, %rate, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)  # opt
  output p = %6 donates %p
  output m = %7 donates %m
  output v = %8 donates %v
}",
    )
    .unwrap();
    for seed in 0..4 {
        let inputs = random_inputs(&g, seed);
        let lr = inputs[4].data[0];
        let t = inputs[5].data[0];
        assert!((1e-3..4e-3).contains(&lr), "lr {lr}");
        assert!((1.0..=8.0).contains(&t) && t.fract() == 0.0, "step {t}");
        assert!(inputs[3].data.iter().all(|v| *v >= 0.0));
        assert!(rms(&inputs[2].data) < 1e-2 && rms(&inputs[3].data) < 1e-3);
        assert!(
            (rms(&inputs[0].data) - 1.0).abs() < 0.1,
            "a rank-1 param is a scale"
        );
    }
    compare_numerics(&g, &g, Tier::Preserving, 3).unwrap();
}

fn rms(xs: &[f64]) -> f64 {
    (xs.iter().map(|x| x * x).sum::<f64>() / xs.len() as f64).sqrt()
}

// ---- the `tiny` train step ----

fn tiny_train_step() -> Graph {
    let traced = Llama3Config::builtin("tiny")
        .expect("`tiny` is a built-in config")
        .trace(DType::F32)
        .expect("tiny traces");
    build_train_step(traced, "loss", &OptimConfig::default())
        .expect("tiny builds a train step")
        .graph
}

fn input_index(g: &Graph, name: &str) -> usize {
    g.inputs.iter().position(|i| i.name == name).unwrap()
}

#[test]
fn the_tiny_step_gets_a_valid_training_state_and_finite_outputs() {
    let g = tiny_train_step();
    for seed in 0..2 {
        let inputs = random_inputs(&g, seed);
        let lr = inputs[input_index(&g, "lr")].data[0];
        let step = inputs[input_index(&g, "step")].data[0];
        assert!((1e-3..4e-3).contains(&lr), "lr {lr}");
        assert!(step >= 1.0 && step.fract() == 0.0, "step {step}");
        let vocab = g.ty(g.inputs[input_index(&g, "output.weight")].value).shape[0] as f64;
        for name in ["tokens", "targets"] {
            let ids = &inputs[input_index(&g, name)].data;
            assert!(ids.iter().all(|t| *t >= 0.0 && *t < vocab), "{name}");
        }
        for (input, t) in g.inputs.iter().zip(&inputs) {
            if input.name.starts_with("opt.v.") {
                assert_eq!(input.kind, InputKind::State);
                assert!(t.data.iter().all(|v| *v >= 0.0), "{}", input.name);
            }
        }
        let out = run(&g, &inputs).unwrap();
        for (o, t) in g.outputs.iter().zip(&out.outputs) {
            assert!(t.data.iter().all(|x| x.is_finite()), "{}", o.name);
        }
        // The gradients reach the first moments: m' = 0.9 m + 0.1 g moves m by more than
        // rounding on every parameter.
        for (o, t) in g.outputs.iter().zip(&out.outputs) {
            if o.name.starts_with("opt.m.") {
                let m = &inputs[input_index(&g, &o.name)].data;
                let moved: Vec<f64> = t.data.iter().zip(m).map(|(a, b)| a - 0.9 * b).collect();
                assert!(rms(&moved) > 1e-3 * rms(&t.data), "{}", o.name);
            }
        }
    }
    let compared = compare_numerics_counted(&g, &g, Tier::Preserving, 2).unwrap();
    let per_trial: usize = g.outputs.iter().map(|o| g.ty(o.value).numel()).sum();
    assert_eq!(compared.elements, 2 * per_trial);
    assert_eq!(compared.outputs, g.outputs.len());
}

/// Sets an AdamW hyperparameter on every optimizer node.
fn adamw_attr(tier: Tier, set: fn(&mut Op)) -> Edit<impl Fn(&mut Graph)> {
    edit(tier, move |g| {
        for n in &mut g.nodes {
            if matches!(n.op, Op::AdamW { .. }) {
                set(&mut n.op);
            }
        }
    })
}

fn flip_weight_decay(op: &mut Op) {
    if let Op::AdamW { weight_decay, .. } = op {
        *weight_decay = -*weight_decay;
    }
}

/// Negates operand `pos` of every `adamw` node (1: the gradient, 4: the learning rate).
fn negate_adamw_operand(tier: Tier, pos: usize) -> Edit<impl Fn(&mut Graph)> {
    edit(tier, move |g| {
        let mut nodes = Vec::with_capacity(g.nodes.len());
        for mut n in std::mem::take(&mut g.nodes) {
            if matches!(n.op, Op::AdamW { .. }) {
                let x = n.inputs[pos];
                let neg = ValueId(g.values.len() as u32);
                g.values.push(g.ty(x).clone());
                nodes.push(Node {
                    op: Op::Unary(UnaryOp::Neg),
                    inputs: vec![x],
                    outputs: vec![neg],
                    meta: n.meta.clone(),
                });
                n.inputs[pos] = neg;
            }
            nodes.push(n);
        }
        g.nodes = nodes;
        *g = g.canonical();
    })
}

fn assert_caught(g: &Graph, pass: &dyn Pass, what: &str) -> String {
    let (after, _) = pass.run(g).unwrap();
    verify(&after).unwrap();
    let err = compare_numerics(g, &after, pass.tier(), 2)
        .expect_err(&format!("{what} ({}) must fail", pass.tier().label()));
    println!("{what}, {}: {err}", pass.tier().label());
    err
}

#[test]
fn a_flipped_weight_decay_fails_on_the_tiny_step() {
    let g = tiny_train_step();
    for tier in both_tiers() {
        let err = assert_caught(
            &g,
            &adamw_attr(tier, flip_weight_decay),
            "weight decay flipped",
        );
        // Only the parameter outputs change (not loss, grad_norm or the moments).
        assert!(
            err.contains("output `tok_embeddings.weight` element"),
            "{err}"
        );
        assert!(!err.contains("not finite"), "{err}");
    }
}

#[test]
fn a_negated_gradient_or_learning_rate_or_a_changed_eps_fails_on_the_tiny_step() {
    let g = tiny_train_step();
    for tier in both_tiers() {
        assert_caught(&g, &negate_adamw_operand(tier, 1), "gradient negated");
        assert_caught(&g, &negate_adamw_operand(tier, 4), "learning rate negated");
    }
    // A changed eps only moves updates where the second moment is tiny; tier 2 sees it now.
    let eps = |op: &mut Op| {
        if let Op::AdamW { eps, .. } = op {
            *eps = 1e-6;
        }
    };
    assert_caught(&g, &adamw_attr(Tier::Changing, eps), "eps 1e-8 -> 1e-6");
}

/// The defect this file guards against: with N(0, 1) for every float input (the old inputs),
/// seed 0 draws `step` near -1, the bias correction's square root is NaN, and every parameter
/// output is NaN in both graphs, so the wrong weight decay above passed a NaN-equals-NaN check
/// on that seed. The new inputs give finite values that differ.
#[test]
fn old_normal_inputs_made_every_parameter_update_nan() {
    let g = tiny_train_step();
    let (after, _) = adamw_attr(Tier::Preserving, flip_weight_decay)
        .run(&g)
        .unwrap();
    let seed = 0;
    let old: Vec<HostTensor> = g
        .inputs
        .iter()
        .zip(random_inputs(&g, seed))
        .enumerate()
        .map(|(k, (_, new))| {
            if new.ty.dtype.is_int() {
                new // the ids: the same rule then and now
            } else {
                HostTensor::from_fn(new.ty, |i| rng::normal(seed, k as u64, i as u64))
            }
        })
        .collect();
    let params: Vec<usize> = g
        .inputs
        .iter()
        .filter(|i| i.kind == InputKind::Param)
        .map(|i| g.outputs.iter().position(|o| o.name == i.name).unwrap())
        .collect();
    assert!(old[input_index(&g, "step")].data[0] < 0.0);
    let (a, b) = (run(&g, &old).unwrap(), run(&after, &old).unwrap());
    for &o in &params {
        assert!(a.outputs[o].data.iter().all(|x| x.is_nan()));
        assert!(b.outputs[o].data.iter().all(|x| x.is_nan()));
    }
    let new = random_inputs(&g, seed);
    let (a, b) = (run(&g, &new).unwrap(), run(&after, &new).unwrap());
    for &o in &params {
        assert!(a.outputs[o].data.iter().all(|x| x.is_finite()));
        assert_ne!(
            a.outputs[o].data, b.outputs[o].data,
            "{}",
            g.outputs[o].name
        );
    }
}
