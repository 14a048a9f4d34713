//! The numerics gate for passes: trains the same model twice from the same seed, once on the
//! unoptimized train step and once after a pass pipeline, and compares loss and grad norm at every
//! step and every parameter and optimizer-state tensor at the end. Bitwise for a tier-1 pipeline,
//! within a relative tolerance for tier 2.
//!
//! `check_pipeline` runs both on the reference interpreter; `check_pipeline_on` runs the
//! unoptimized step lowered eagerly (one kernel per op) against the optimized step lowered with
//! fusion, on one compiled backend — the gate the lowering work and the passes share. Both
//! steps are compiled by the one driver (`graphtrain_runtime::compile`, through the trainer).

use crate::data::DataSource;
use crate::lr_schedule::LrSchedule;
use crate::trainer::{MeshRun, TrainConfig, Trainer};
use crate::tuning::Tuning;
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::HostTensor;
use graphtrain_ir::InputKind;
use graphtrain_lowering::Mode;
use graphtrain_models::Llama3Config;
use graphtrain_passes::{Pipeline, Tier};
use graphtrain_runtime::{Backend, CompileOptions};

/// Relative tolerance of the tier-2 gate (f32 training).
pub const TIER2_TOLERANCE: f64 = 1e-4;

fn same(a: f64, b: f64, tier: Tier) -> bool {
    match tier {
        Tier::Preserving => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
        Tier::Changing => a == b || (a - b).abs() <= TIER2_TOLERANCE * (1.0 + a.abs().max(b.abs())),
    }
}

/// The device backends a test should run here: wgpu when it can run. Where it cannot, the test
/// skips that part with a message, except under CI (`CI` set), which installs lavapipe: there a
/// missing adapter is a broken setup, and this panics rather than let the test pass.
pub fn device_backends_for_tests() -> Vec<Backend> {
    match Backend::Wgpu.unavailable() {
        None => vec![Backend::Wgpu],
        Some(why) if std::env::var_os("CI").is_some() => panic!("wgpu must run under CI: {why}"),
        Some(why) => {
            eprintln!("skipping the wgpu part of this test: {why}");
            Vec::new()
        }
    }
}

/// Runs `steps` AdamW steps with and without `pipeline`; `Err` names the first difference.
pub fn check_pipeline(model: &Llama3Config, pipeline: &Pipeline, steps: u64) -> Result<(), String> {
    check_pipeline_on(model, pipeline, steps, Backend::Reference)
}

/// As `check_pipeline`, on `backend`: the unoptimized step runs eager (op by op), the optimized
/// one fused.
pub fn check_pipeline_on(
    model: &Llama3Config,
    pipeline: &Pipeline,
    steps: u64,
    backend: Backend,
) -> Result<(), String> {
    check_pipeline_tuned(
        model,
        pipeline,
        steps,
        backend,
        None,
        &Tuning::default(),
        Precision::F32,
    )
}

/// As `check_pipeline_on`, both steps on `mesh` (the SPMD step on every rank) when given, the
/// optimized one lowered and run under `tuning`. The cpu GEMM kernel applies to both: under
/// bf16-mixed the AMX tiles, the `vdpbf16ps` GEMM and the f32 one round differently (each
/// within bf16's rounding of the interpreter, which the backend tests check), and the gate
/// judges the pipeline and its lowering, not a choice of kernel. In f32 every kernel gives the
/// same bits.
pub fn check_pipeline_tuned(
    model: &Llama3Config,
    pipeline: &Pipeline,
    steps: u64,
    backend: Backend,
    mesh: Option<&MeshRun>,
    tuning: &Tuning,
    precision: Precision,
) -> Result<(), String> {
    let cfg = TrainConfig {
        data: DataSource::Random,
        seed: 0,
        lr: LrSchedule::constant(1e-3),
        optim: OptimConfig::default(),
    };
    let tier = pipeline.tier();
    let no_passes = Pipeline::new(Vec::new());
    let mut unoptimized = CompileOptions {
        precision,
        ..CompileOptions::new(&no_passes, Mode::Eager)
    };
    if let Some(kernel) = tuning.gemm {
        unoptimized.runtime.gemm_kernel = kernel;
    }
    if let Some(lanes) = tuning.map_vector {
        unoptimized.runtime.map_vector = lanes;
    }
    let mut base = Trainer::build_on(model, cfg.clone(), backend, &unoptimized, mesh)
        .map_err(|e| e.to_string())?;
    let mut optimized = CompileOptions::new(pipeline, Mode::Fused);
    optimized.fusion = tuning.fusion;
    optimized.precision = precision;
    if let Some(kernel) = tuning.gemm {
        optimized.runtime.gemm_kernel = kernel;
    }
    if let Some(lanes) = tuning.map_vector {
        optimized.runtime.map_vector = lanes;
    }
    if let Some(how) = tuning.device_collectives {
        optimized.runtime.device_collectives = how;
    }
    if let Some(graphs) = tuning.device_graphs {
        optimized.runtime.device_graphs = graphs;
    }
    if let Some(kernel) = tuning.device_matmul {
        optimized.runtime.device_matmul = kernel;
    }
    let mut opt =
        Trainer::build_on(model, cfg, backend, &optimized, mesh).map_err(|e| e.to_string())?;
    for _ in 0..steps {
        let a = base.step().map_err(|e| format!("unoptimized: {e}"))?;
        let b = opt.step().map_err(|e| format!("optimized: {e}"))?;
        if !same(a.loss, b.loss, tier) || !same(a.grad_norm, b.grad_norm, tier) {
            return Err(format!(
                "step {}: loss {:e} vs {:e}, grad_norm {:e} vs {:e} ({})",
                a.step,
                a.loss,
                b.loss,
                a.grad_norm,
                b.grad_norm,
                tier.label()
            ));
        }
    }
    for name in carried_names(&base) {
        let a = base.input_value(&name).expect("the input exists").clone();
        let b = opt
            .input_value(&name)
            .ok_or_else(|| format!("the optimized step lost input `{name}`"))?;
        if let Some(i) = (0..a.data.len()).find(|&i| !same(a.data[i], b.data[i], tier)) {
            return Err(format!(
                "after {steps} steps `{}` element {i} differs: {:e} vs {:e} ({})",
                name,
                a.data[i],
                b.data[i],
                tier.label()
            ));
        }
    }
    Ok(())
}

/// Names of the inputs carried from step to step: parameters and optimizer state.
fn carried_names(t: &Trainer) -> Vec<String> {
    t.graph
        .inputs
        .iter()
        .filter(|i| i.kind != InputKind::Data)
        .map(|i| i.name.clone())
        .collect()
}

/// What one training run left behind: per-step loss and grad norm, and every parameter and
/// optimizer-state tensor at the end.
pub struct RunRecord {
    pub losses: Vec<f64>,
    pub grad_norms: Vec<f64>,
    pub state: Vec<(String, HostTensor)>,
}

/// Trains the built-in config `config` for `steps` steps (fixed data, seed 0, no passes) on
/// each of two backends/lowerings, for comparisons between them.
pub fn train_on_backends(
    config: &str,
    steps: u64,
    first: Backend,
    first_mode: Mode,
    second: Backend,
    second_mode: Mode,
) -> Result<(RunRecord, RunRecord), String> {
    train_on_backends_in(
        config,
        steps,
        Precision::F32,
        (first, first_mode),
        (second, second_mode),
    )
}

/// `train_on_backends` with both runs under `precision`.
pub fn train_on_backends_in(
    config: &str,
    steps: u64,
    precision: Precision,
    (first, first_mode): (Backend, Mode),
    (second, second_mode): (Backend, Mode),
) -> Result<(RunRecord, RunRecord), String> {
    let model =
        Llama3Config::builtin(config).ok_or_else(|| format!("unknown config `{config}`"))?;
    let run = |backend: Backend, mode: Mode| -> Result<RunRecord, String> {
        let cfg = TrainConfig {
            data: DataSource::Fixed,
            seed: 0,
            lr: LrSchedule::constant(1e-3),
            optim: OptimConfig::default(),
        };
        let no_passes = Pipeline::new(Vec::new());
        let options = CompileOptions {
            precision,
            ..CompileOptions::new(&no_passes, mode)
        };
        let mut t = Trainer::build(&model, cfg, backend, &options).map_err(|e| e.to_string())?;
        let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let m = t.step().map_err(|e| format!("{backend}: {e}"))?;
            losses.push(m.loss);
            grad_norms.push(m.grad_norm);
        }
        let state = carried_names(&t)
            .into_iter()
            .map(|n| {
                let v = t.input_value(&n).expect("the input exists").clone();
                (n, v)
            })
            .collect();
        Ok(RunRecord {
            losses,
            grad_norms,
            state,
        })
    };
    Ok((run(first, first_mode)?, run(second, second_mode)?))
}
