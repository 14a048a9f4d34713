//! The optimizer options the README offers beyond AdamW: SGD, and clipping of the global
//! gradient norm. SGD makes the update readable: after one step `(p - p') / lr` is the gradient
//! the optimizer used, so its norm is the grad norm, clipped or not.

use graphtrain::data::DataMode;
use graphtrain::ir::optim::{OptimConfig, Optimizer};
use graphtrain::ir::InputKind;
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_lowering::Mode;
use graphtrain_runtime::Backend;

const LR: f64 = 1e-2;

fn sgd_trainer(max_grad_norm: Option<f64>, backend: Backend) -> Trainer {
    let mut t = Trainer::new(
        &Llama3Config::builtin("tiny").unwrap(),
        TrainConfig {
            data: DataMode::Fixed.into(),
            seed: 0,
            lr: LrSchedule::constant(LR),
            optim: OptimConfig {
                optimizer: Optimizer::Sgd { weight_decay: 0.0 },
                max_grad_norm,
                micro_batches: 1,
            },
        },
        &Pipeline::new(Vec::new()),
    )
    .unwrap();
    t.use_backend(backend, Mode::Fused).unwrap();
    t
}

/// Every parameter, by name, as it is now.
fn params(t: &mut Trainer) -> Vec<(String, Vec<f64>)> {
    let names: Vec<String> = t
        .graph
        .inputs
        .iter()
        .filter(|i| i.kind == InputKind::Param)
        .map(|i| i.name.clone())
        .collect();
    names
        .into_iter()
        .map(|n| {
            let v = t.input_value(&n).unwrap().data.clone();
            (n, v)
        })
        .collect()
}

/// `‖(p - p') / lr‖` over every parameter: the norm of the gradient the step applied.
fn applied_gradient_norm(before: &[(String, Vec<f64>)], after: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(before.len(), after.len());
    let mut sum = 0.0;
    for ((name, a), (_, b)) in before.iter().zip(after) {
        assert_eq!(a.len(), b.len(), "{name}");
        for (x, y) in a.iter().zip(b) {
            assert!(x.is_finite() && y.is_finite(), "{name}: {x} -> {y}");
            sum += ((x - y) / LR).powi(2);
        }
    }
    sum.sqrt()
}

#[test]
fn sgd_applies_the_gradient_and_trains() {
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut t = sgd_trainer(None, backend);
        let before = params(&mut t);
        let first = t.step().unwrap();
        let applied = applied_gradient_norm(&before, &params(&mut t));
        // The update is `-lr · g`, rounded to f32 per element.
        let rel = (applied - first.grad_norm).abs() / first.grad_norm;
        assert!(
            rel < 1e-3,
            "{backend}: applied {applied}, grad_norm {}",
            first.grad_norm
        );
        let losses: Vec<f64> = (0..30).map(|_| t.step().unwrap().loss).collect();
        assert!(
            losses[29] < 0.9 * first.loss,
            "{backend}: SGD at lr {LR} did not train: {} -> {losses:?}",
            first.loss
        );
    }
}

#[test]
fn clipping_scales_the_step_to_the_max_norm_and_only_when_above_it() {
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut free = sgd_trainer(None, backend);
        let unclipped = free.step().unwrap();
        let norm = unclipped.grad_norm;
        let free_after = params(&mut free);

        // Below the norm: the applied gradient has the max norm (scaled by max / (norm + 1e-6)),
        // and `grad_norm` still reports the norm before clipping.
        let max = norm / 4.0;
        let mut clipped = sgd_trainer(Some(max), backend);
        let before = params(&mut clipped);
        let m = clipped.step().unwrap();
        assert_eq!(m.grad_norm.to_bits(), norm.to_bits(), "{backend}");
        assert_eq!(m.loss.to_bits(), unclipped.loss.to_bits(), "{backend}");
        let applied = applied_gradient_norm(&before, &params(&mut clipped));
        let want = norm * max / (norm + 1e-6);
        assert!(
            (applied - want).abs() / want < 1e-3,
            "{backend}: applied {applied}, want {want} (grad norm {norm}, max {max})"
        );

        // Above the norm: the scale is exactly 1 and the step is bitwise the unclipped one.
        let mut loose = sgd_trainer(Some(norm * 10.0), backend);
        loose.step().unwrap();
        for ((name, a), (_, b)) in params(&mut loose).iter().zip(&free_after) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{backend}: `{name}` differs though the norm is under the max"
            );
        }
    }
}
