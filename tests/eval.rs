//! Forward-only runs: the validation graph gives the train step's own loss for the same weights
//! and batch, and sampling sees only the context before each position (right padding is
//! invisible), on the interpreter and on cpu.

use graphtrain::data::{batch, DataMode};
use graphtrain::eval::{generate, validate, Forward, Sampling};
use graphtrain::ir::optim::OptimConfig;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_lowering::Mode;
use graphtrain_runtime::{Backend, RuntimeOptions};

fn tiny() -> Llama3Config {
    Llama3Config::builtin("tiny").unwrap()
}

fn trainer_on(backend: Backend) -> Trainer {
    let cfg = TrainConfig {
        data: DataMode::Fixed,
        seed: 5,
        lr: 1e-2,
        optim: OptimConfig::default(),
    };
    let mut t = Trainer::new(&tiny(), cfg, &Pipeline::new(Vec::new())).unwrap();
    if backend != Backend::Reference {
        t.use_backend(backend, Mode::Fused).unwrap();
    }
    t
}

fn load(forward: &mut Forward, t: &mut Trainer) {
    let names: Vec<String> = forward.param_names().map(str::to_string).collect();
    let values: Vec<_> = names.iter().map(|n| t.input_value(n).cloned()).collect();
    forward
        .load_params(|name| {
            names
                .iter()
                .position(|n| n == name)
                .and_then(|i| values[i].as_ref())
        })
        .unwrap();
}

#[test]
fn validation_loss_is_the_train_steps_loss_for_the_same_weights_and_batch() {
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut t = trainer_on(backend);
        // Train a few steps so the weights are not the initial ones.
        for _ in 0..3 {
            t.step().unwrap();
        }
        let m = tiny();
        let fixed = batch(DataMode::Fixed, 5, 0, m.batch, m.seq_len, m.vocab_size);
        let mut forward = Forward::validation(&m, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        let v = validate(&mut forward, std::slice::from_ref(&fixed)).unwrap();
        // Step 4's reported loss is the forward loss of the weights after step 3.
        let step = t.step().unwrap();
        let rel = (v.loss - step.loss).abs() / step.loss.abs();
        assert!(
            rel <= 1e-6,
            "{backend}: validation {} vs train step {}",
            v.loss,
            step.loss
        );
        assert!((v.perplexity - v.loss.exp()).abs() <= 1e-12 * v.perplexity);
    }
}

#[test]
fn logits_at_a_position_do_not_depend_on_later_tokens() {
    let mut backends = vec![Backend::Reference, Backend::Cpu];
    backends.extend(graphtrain::gate::device_backends_for_tests());
    for backend in backends {
        let m = tiny();
        let mut t = trainer_on(backend);
        t.step().unwrap();
        let mut forward =
            Forward::logits(&m, 1, m.seq_len, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        let prefix = [3i64, 17, 42, 5, 9];
        let mut a = prefix.to_vec();
        a.resize(m.seq_len, 0);
        let mut b = prefix.to_vec();
        b.extend((prefix.len()..m.seq_len).map(|i| (i * 7 % 60) as i64 + 1));
        let (la, lb) = (
            forward.run_logits(&a).unwrap(),
            forward.run_logits(&b).unwrap(),
        );
        let v = m.vocab_size;
        let upto = prefix.len() * v;
        assert_eq!(
            la.data[..upto],
            lb.data[..upto],
            "{backend}: the prefix's logits changed"
        );
        assert_ne!(
            la.data[upto..],
            lb.data[upto..],
            "later positions must see their tokens"
        );
    }
}

#[test]
fn greedy_generation_is_the_same_on_cpu_and_on_the_interpreter() {
    let m = tiny();
    let greedy = Sampling {
        temperature: 0.0,
        top_k: 0,
        seed: 0,
    };
    let mut outs = Vec::new();
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut t = trainer_on(backend);
        for _ in 0..5 {
            t.step().unwrap();
        }
        let mut forward =
            Forward::logits(&m, 1, m.seq_len, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        // Longer than one context, so the window slides.
        let out = generate(&mut forward, &[1, 2, 3], m.seq_len + 4, &greedy).unwrap();
        assert_eq!(out.len(), m.seq_len + 4);
        assert!(out.iter().all(|&t| (0..m.vocab_size as i64).contains(&t)));
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1]);
}

#[test]
fn a_validation_graph_refuses_weights_it_cannot_use() {
    let m = tiny();
    let mut forward =
        Forward::validation(&m, Backend::Reference, &RuntimeOptions::default()).unwrap();
    let e = forward.load_params(|_| None).unwrap_err();
    assert!(e.0.contains("needs parameter `"), "{e}");
    let wrong = graphtrain::ir::HostTensor::zeros(graphtrain::ir::TensorType::new(
        graphtrain::ir::DType::F32,
        [3],
    ));
    let e = forward.load_params(|_| Some(&wrong)).unwrap_err();
    assert!(e.0.contains("the forward pass needs"), "{e}");
}
