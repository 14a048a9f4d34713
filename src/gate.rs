//! The numerics gate for passes: trains the same model twice from the same seed, once on the
//! unoptimized train step and once after a pass pipeline, and compares loss and grad norm at every
//! step and every parameter and optimizer-state tensor at the end. Bitwise for a tier-1 pipeline,
//! within a relative tolerance for tier 2.
//!
//! Today both runs execute on the reference interpreter; when the cubecl backends land, the same
//! gate runs the lowered program against eager op-by-op execution on one backend.

use crate::data::DataMode;
use crate::trainer::{TrainConfig, Trainer};
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::InputKind;
use graphtrain_models::Llama3Config;
use graphtrain_passes::{Pipeline, Tier};

/// Relative tolerance of the tier-2 gate (f32 training).
pub const TIER2_TOLERANCE: f64 = 1e-4;

fn same(a: f64, b: f64, tier: Tier) -> bool {
    match tier {
        Tier::Preserving => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
        Tier::Changing => a == b || (a - b).abs() <= TIER2_TOLERANCE * (1.0 + a.abs().max(b.abs())),
    }
}

/// Runs `steps` AdamW steps with and without `pipeline`; `Err` names the first difference.
pub fn check_pipeline(model: &Llama3Config, pipeline: &Pipeline, steps: u64) -> Result<(), String> {
    let cfg = TrainConfig {
        data: DataMode::Random,
        seed: 0,
        lr: 1e-3,
        optim: OptimConfig::default(),
    };
    let tier = pipeline.tier();
    let mut base =
        Trainer::new(model, cfg.clone(), &Pipeline::new(Vec::new())).map_err(|e| e.to_string())?;
    let mut opt = Trainer::new(model, cfg, pipeline).map_err(|e| e.to_string())?;
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
    for input in base
        .graph
        .inputs
        .iter()
        .filter(|i| i.kind != InputKind::Data)
    {
        let a = base.input_value(&input.name).expect("the input exists");
        let b = opt
            .input_value(&input.name)
            .ok_or_else(|| format!("the optimized step lost input `{}`", input.name))?;
        if let Some(i) = (0..a.data.len()).find(|&i| !same(a.data[i], b.data[i], tier)) {
            return Err(format!(
                "after {steps} steps `{}` element {i} differs: {:e} vs {:e} ({})",
                input.name,
                a.data[i],
                b.data[i],
                tier.label()
            ));
        }
    }
    Ok(())
}
