//! Training on the reference interpreter: the loss falls on a fixed batch, runs are reproducible,
//! and a diverging run stops with an error naming the step, keeping the last good state where
//! the backend can.

use graphtrain::checkpoint::RunIdentity;
use graphtrain::data::DataMode;
use graphtrain::ir::optim::OptimConfig;
use graphtrain::lr_schedule::{Decay, LrSchedule};
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_lowering::Mode;
use graphtrain_runtime::Backend;

fn trainer(data: DataMode, lr: f64) -> Trainer {
    let cfg = Llama3Config::builtin("tiny").unwrap();
    Trainer::new(
        &cfg,
        TrainConfig {
            data: data.into(),
            seed: 0,
            lr: LrSchedule::constant(lr),
            optim: OptimConfig::default(),
        },
        &Pipeline::new(Vec::new()),
    )
    .unwrap()
}

#[test]
fn loss_falls_monotonically_at_the_default_learning_rate() {
    let mut t = trainer(DataMode::Fixed, 1e-3);
    let losses: Vec<f64> = (0..20).map(|_| t.step().unwrap().loss).collect();
    for w in losses.windows(2) {
        assert!(w[1] < w[0], "loss rose: {losses:?}");
    }
}

#[test]
fn loss_falls_monotonically_and_fast_at_a_high_learning_rate() {
    let mut t = trainer(DataMode::Fixed, 1e-2);
    let losses: Vec<f64> = (0..20).map(|_| t.step().unwrap().loss).collect();
    // Uniform prediction over the 64-token vocab gives ln 64 = 4.16 at init.
    assert!(
        (losses[0] - 64f64.ln()).abs() < 0.1,
        "initial loss {}",
        losses[0]
    );
    for w in losses.windows(2) {
        assert!(w[1] < w[0], "loss rose: {losses:?}");
    }
    assert!(
        losses[19] < 0.5 * losses[0],
        "loss fell too little: {losses:?}"
    );
}

// A schedule's lr reaches the update of its step: warm-up over two steps to `peak` trains as a
// constant `peak / 2` for step 1 followed by a constant `peak`, bit for bit. Fed the peak from
// step 1 (a schedule that never reached the step input), step 2's loss would differ.
#[test]
fn each_step_updates_with_its_scheduled_lr() {
    let peak = 1e-2;
    let mut warm = trainer(DataMode::Fixed, peak);
    warm.set_lr_schedule(LrSchedule {
        peak,
        warmup: 2,
        decay: Decay::Cosine,
        min_ratio: 0.1,
        total: 4,
    });
    let mut by_hand = trainer(DataMode::Fixed, peak / 2.0);
    let mut pairs = Vec::new();
    for step in 1..=4u64 {
        let scheduled = match step {
            1 => peak / 2.0,
            2 => peak,
            // Half of the decay (steps 3 and 4) done: the mean of peak and floor; then the floor.
            3 => 0.55 * peak,
            _ => 0.1 * peak,
        };
        by_hand.set_lr_schedule(LrSchedule::constant(scheduled));
        let (a, b) = (warm.step().unwrap(), by_hand.step().unwrap());
        assert!((a.lr - scheduled).abs() < 1e-15, "step {step}: lr {}", a.lr);
        pairs.push((a.loss, b.loss));
    }
    for (step, (a, b)) in pairs.iter().enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {}: {pairs:?}", step + 1);
    }
    assert_ne!(pairs[1].0, pairs[0].0, "the steps trained");
}

#[test]
fn same_seed_same_losses() {
    let mut a = trainer(DataMode::Random, 1e-3);
    let mut b = trainer(DataMode::Random, 1e-3);
    for _ in 0..3 {
        assert_eq!(
            a.step().unwrap().loss.to_bits(),
            b.step().unwrap().loss.to_bits()
        );
    }
}

#[test]
fn a_diverging_run_stops_with_a_clear_error() {
    let mut t = trainer(DataMode::Fixed, 1e30);
    let err = (0..10)
        .find_map(|_| t.step().err())
        .expect("an lr of 1e30 must blow the loss up within 10 steps");
    assert!(err.0.contains("loss is"), "{err}");
    assert!(err.0.starts_with("step "), "{err}");
}

/// Steps `t` until one fails, and returns the error and how many steps succeeded.
fn until_divergence(t: &mut Trainer) -> (String, u64) {
    for done in 0..10 {
        if let Err(e) = t.step() {
            return (e.0, done);
        }
    }
    panic!("an lr of 1e30 must blow the loss up within 10 steps");
}

fn run_identity(t: &Trainer) -> RunIdentity {
    RunIdentity::new(&t.model, 0, DataMode::Fixed, &OptimConfig::default())
}

#[test]
fn a_failed_step_on_the_interpreter_keeps_nothing_of_its_update() {
    let mut failed = trainer(DataMode::Fixed, 1e30);
    let (err, done) = until_divergence(&mut failed);
    assert!(err.contains("stopping before the update is kept"), "{err}");
    let after = failed
        .checkpoint(run_identity(&failed))
        .expect("the interpreter's state is the last good step's");
    // The same run stopped before the failing step.
    let mut good = trainer(DataMode::Fixed, 1e30);
    for _ in 0..done {
        good.step().unwrap();
    }
    let before = good.checkpoint(run_identity(&good)).unwrap();
    assert_eq!(after.header.steps_done, done);
    assert_eq!(after.tensors.len(), before.tensors.len());
    let bits = |t: &graphtrain::ir::HostTensor| -> Vec<u64> {
        t.data.iter().map(|x| x.to_bits()).collect()
    };
    for (a, b) in after.tensors.iter().zip(&before.tensors) {
        assert!(bits(a) == bits(b), "a tensor changed in the failed step");
    }
}

#[test]
fn a_failed_step_on_a_compiled_backend_refuses_to_be_checkpointed() {
    let mut t = trainer(DataMode::Fixed, 1e30);
    t.use_backend(Backend::Cpu, Mode::Fused).unwrap();
    let (err, _) = until_divergence(&mut t);
    assert!(err.contains("updates in place"), "{err}");
    let Err(refused) = t.checkpoint(run_identity(&t)) else {
        panic!("the state after a failed in-place step is no step's: it must not checkpoint");
    };
    assert!(refused.0.contains("last good state"), "{refused}");
}
