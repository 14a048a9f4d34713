//! The burn frontend against burn itself: a Llama-style model written with burn-nn, captured
//! and imported, gives burn's loss and (through graphtrain's autodiff, on the reference
//! interpreter) burn autodiff's gradients; the recognised composites are the ones its
//! lowering has kernels for; bad input is refused by name.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};
use graphtrain_burn::llama::{Llama, LlamaConfig};
use graphtrain_burn::{capture_loss, import, weights, Imported};
use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::{autodiff, interp, verify, DType, HostTensor, TensorType};
use graphtrain_passes::pipeline::PipelineSpec;
use graphtrain_passes::registry::Registry;
use graphtrain_passes::testing::compare_numerics;

const CFG: LlamaConfig = LlamaConfig {
    vocab_size: 64,
    dim: 32,
    n_layers: 2,
    n_heads: 4,
    ffn_dim: 64,
    max_seq_len: 16,
    rope_theta: 10000.0,
    norm_eps: 1e-5,
};
const BATCH: usize = 2;
const SEQ: usize = 16;

/// Token ids and targets, deterministic and spread over the vocabulary.
fn batch() -> (TensorData, TensorData) {
    let n = BATCH * SEQ;
    let tokens: Vec<i64> = (0..n)
        .map(|i| ((i * 7 + 3) % CFG.vocab_size) as i64)
        .collect();
    let targets: Vec<i64> = (0..n)
        .map(|i| ((i * 11 + 5) % CFG.vocab_size) as i64)
        .collect();
    (
        TensorData::new(tokens, [BATCH, SEQ]),
        TensorData::new(targets, [BATCH, SEQ]),
    )
}

/// The model on `device` with deterministic weights (norm gains near 1, the rest small).
fn model(device: &Device) -> Llama {
    let init = CFG.init(device);
    let values: Vec<(String, HostTensor)> = weights::values(&init)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(k, (name, t))| {
            let gain = name.ends_with("gamma");
            let host = HostTensor::from_fn(t.ty.clone(), |i| {
                let u = ((i * 2654435761 + k * 40503) % 1000) as f64 / 1000.0 - 0.5;
                if gain {
                    1.0 + 0.2 * u
                } else {
                    0.2 * u
                }
            });
            (name, host)
        })
        .collect();
    weights::apply(init, &values).unwrap()
}

fn capture_and_import(m: &Llama) -> Imported {
    let (tokens, targets) = batch();
    let captured = capture_loss(m, &[("tokens", tokens), ("targets", targets)], |m, t| {
        m.loss(t[0].clone(), t[1].clone())
    })
    .unwrap();
    import(&captured).unwrap()
}

/// The imported graph's inputs fed: parameters from `initial`, tokens and targets from the batch.
fn feeds(imported: &Imported, g: &graphtrain_ir::Graph) -> Vec<HostTensor> {
    let (tokens, targets) = batch();
    let ints = |d: &TensorData| {
        let v: Vec<f64> = d
            .clone()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| x as f64)
            .collect();
        HostTensor::new(TensorType::new(DType::I32, [BATCH, SEQ]), v).unwrap()
    };
    g.inputs
        .iter()
        .map(|i| match i.name.as_str() {
            "tokens" => ints(&tokens),
            "targets" => ints(&targets),
            name => imported
                .initial
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("no value for input {name}"))
                .1
                .clone(),
        })
        .collect()
}

/// burn's gradients by parameter path.
struct Grads<'a> {
    stack: Vec<String>,
    grads: &'a burn::tensor::Gradients,
    out: Vec<(String, Vec<f32>)>,
}

impl ModuleVisitor for Grads<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let g = p
            .val()
            .grad(self.grads)
            .expect("every parameter has a gradient");
        let v = g.to_data().convert::<f32>().try_into_vec::<f32>().unwrap();
        self.out.push((self.stack.join("."), v));
    }
}

fn relative(a: &[f64], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - *y as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    if diff.is_nan() || norm.is_nan() {
        return f64::INFINITY;
    }
    diff / norm.max(1e-30)
}

#[test]
fn the_imported_loss_and_gradients_are_burns() {
    let device = Device::flex().autodiff();
    let m = model(&device);
    let imported = capture_and_import(&m);
    let expected: Vec<(&str, usize)> = vec![
        ("cross_entropy", 1),
        ("rms_norm", 2 * CFG.n_layers + 1),
        ("rope", 2 * CFG.n_layers),
        ("silu", CFG.n_layers),
    ];
    let found: Vec<(&str, usize)> = imported.composites.iter().map(|(k, v)| (*k, *v)).collect();
    assert_eq!(found, expected, "composites recognised");

    // Graphtrain's gradients of the imported loss, on the reference interpreter.
    let mut g = imported.traced.graph.clone();
    let loss = g.output_named("loss").unwrap().value;
    let params: Vec<_> = imported.traced.params.iter().map(|p| p.value).collect();
    let grads = autodiff::grad(&mut g, loss, &params).unwrap();
    for (p, gr) in imported.traced.params.iter().zip(&grads) {
        g.add_output(format!("grad.{}", p.name), *gr, None);
    }
    let inputs = feeds(&imported, &g);
    let out = interp::run(&g, &inputs).unwrap();

    let (tokens, targets) = batch();
    let burn_loss = m.loss(
        Tensor::<2, Int>::from_data(tokens, &device),
        Tensor::<2, Int>::from_data(targets, &device),
    );
    let burn_value = burn_loss.clone().into_scalar::<f32>() as f64;
    let ours = out.outputs[0].data[0];
    assert!(
        ((ours - burn_value) / burn_value).abs() < 1e-5,
        "loss: graphtrain {ours} against burn {burn_value}"
    );

    let burn_grads = burn_loss.backward();
    let mut visitor = Grads {
        stack: Vec::new(),
        grads: &burn_grads,
        out: Vec::new(),
    };
    m.visit(&mut visitor);
    assert_eq!(visitor.out.len(), imported.traced.params.len());
    for (k, (name, want)) in visitor.out.iter().enumerate() {
        let at = g
            .outputs
            .iter()
            .position(|o| o.name == format!("grad.{name}"))
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let got = &out.outputs[at].data;
        let err = relative(got, want);
        assert!(
            err < 1e-4,
            "gradient of {name} (#{k}): relative error {err:.2e}"
        );
    }
}

#[test]
fn parameters_are_named_as_in_burn_and_nodes_carry_their_modules() {
    let m = model(&Device::flex());
    let imported = capture_and_import(&m);
    let names: Vec<&str> = imported
        .traced
        .params
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names.len(), 9 * CFG.n_layers + 3);
    assert_eq!(names[0], "tok_embeddings.weight");
    assert!(
        names.contains(&"layers.1.feed_forward.w3.weight"),
        "{names:?}"
    );
    assert_eq!(*names.last().unwrap(), "output.weight");
    let g = &imported.traced.graph;
    let layer_of = |module: &str| {
        g.nodes
            .iter()
            .filter(|n| n.meta.module == module)
            .map(|n| n.meta.layer)
            .next()
    };
    assert_eq!(layer_of("layers.1.attention.wq"), Some(Some(1)));
    assert_eq!(layer_of("tok_embeddings"), Some(None));
    // Every node inside a layer has the layer's index.
    let unlabelled = g
        .nodes
        .iter()
        .filter(|n| n.meta.module.starts_with("layers.") && n.meta.layer.is_none())
        .count();
    assert_eq!(unlabelled, 0);
    // The whole imported forward, for review: its numerics are the first test's.
    insta::assert_snapshot!(graphtrain_ir::text::print(g));
}

#[test]
fn weights_go_back_into_the_burn_module_and_bad_ones_are_refused() {
    let device = Device::flex();
    let m = model(&device);
    let imported = capture_and_import(&m);
    // Double every weight, write them back, and burn's loss changes as graphtrain's does.
    let doubled: Vec<(String, HostTensor)> = imported
        .initial
        .iter()
        .map(|(n, t)| {
            let data = t.data.iter().map(|x| x * 0.5).collect();
            (n.clone(), HostTensor::new(t.ty.clone(), data).unwrap())
        })
        .collect();
    let back = weights::apply(CFG.init(&device), &doubled).unwrap();
    let read = weights::values(&back).unwrap();
    for ((n1, a), (n2, b)) in doubled.iter().zip(&read) {
        assert_eq!(n1, n2);
        assert_eq!(a.data, b.data, "{n1}");
    }
    let mut wrong_shape = doubled.clone();
    wrong_shape[1].1 = HostTensor::zeros(TensorType::new(DType::F32, [3]));
    let e = weights::apply(CFG.init(&device), &wrong_shape).unwrap_err();
    assert!(
        e.message.contains(&doubled[1].0) && e.message.contains("shape"),
        "{e}"
    );
    let mut unknown = doubled.clone();
    unknown[0].0 = "layers.9.nope.weight".into();
    let e = weights::apply(CFG.init(&device), &unknown).unwrap_err();
    assert!(e.message.contains("layers.9.nope.weight"), "{e}");
    let e = weights::apply(CFG.init(&device), &doubled[1..]).unwrap_err();
    assert!(e.message.contains("tok_embeddings.weight"), "{e}");
}

#[test]
fn an_op_graphtrain_does_not_translate_is_named() {
    let m = model(&Device::flex());
    let (tokens, targets) = batch();
    let captured = capture_loss(&m, &[("tokens", tokens), ("targets", targets)], |m, t| {
        let loss = m.loss(t[0].clone(), t[1].clone());
        // erf: a burn op with no graphtrain counterpart.
        loss.erf()
    })
    .unwrap();
    let e = import(&captured).unwrap_err();
    assert!(e.message.contains("Float/Erf"), "{e}");
    assert!(e.message.contains("graphtrain does not translate"), "{e}");
}

#[test]
fn a_loss_that_captures_nothing_is_refused() {
    let m = model(&Device::flex());
    let (tokens, targets) = batch();
    // A parameter handed back as it is: burn records its data, and no operation.
    let e = capture_loss(&m, &[("tokens", tokens), ("targets", targets)], |m, _| {
        m.norm.gamma.val()
    })
    .unwrap_err();
    assert!(e.message.contains("captured no operation"), "{e}");
}

/// graphtrain's passes run on the imported train step as on a traced one: each pipeline's
/// result verifies and computes what the step computed (bitwise for the numerics-preserving
/// tiers, on seeded inputs), and activation checkpointing finds the imported layers.
#[test]
fn graphtrain_passes_apply_to_the_imported_step() {
    let imported = capture_and_import(&model(&Device::flex()));
    let step = build_train_step(imported.traced, "loss", &OptimConfig::default())
        .unwrap()
        .graph;
    verify(&step).unwrap();
    let registry = Registry::builtin();
    for list in [
        "default",
        "ac=full",
        "ac=selective",
        "ac=names:layers.*.feed_forward.*",
        "ac=full,default",
    ] {
        let pipeline = PipelineSpec::parse_list(list)
            .and_then(|p| p.build(&registry))
            .unwrap_or_else(|e| panic!("{list}: {e}"));
        let (after, _) = pipeline
            .run(&step)
            .unwrap_or_else(|e| panic!("{list}: {e}"));
        verify(&after).unwrap_or_else(|e| panic!("{list}: {e}"));
        if list.starts_with("ac") {
            // Recomputation copies forward nodes into the backward pass.
            assert!(
                after.nodes.len() > step.nodes.len(),
                "{list}: nothing recomputed ({} nodes before, {} after)",
                step.nodes.len(),
                after.nodes.len()
            );
        }
        compare_numerics(&step, &after, pipeline.tier(), 2)
            .unwrap_or_else(|e| panic!("{list}: {e}"));
    }
}
