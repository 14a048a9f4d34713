//! Builds the train step: forward + loss (traced), backward (autodiff), global grad-norm and
//! optional clipping, and the optimizer update, all in one graph.
//!
//! Contract of the result:
//! - inputs: the traced data inputs, then `lr` and `step` (f32 scalars, fed by the host so that
//!   schedules stay outside the graph), the parameters, then the optimizer state;
//! - outputs: `loss`, `grad_norm` (before clipping), then every parameter, then every state
//!   tensor, each donating the input it replaces, so the update happens in place;
//! - optimizer nodes carry phase `opt` and the parameter's name as module path;
//! - with `micro_batches > 1`, the batch is split (`micro_batches.rs`): the data inputs are the
//!   whole batch, the traced forward's batch is one micro-batch's, and `loss` is their mean.

use crate::autodiff::{grad_with, AutodiffError, GradOptions};
use crate::dtype::{DType, TensorType};
use crate::graph::{Graph, InputKind, Meta, Phase, TypeError, ValueId};
use crate::micro_batches;
use crate::op::{BinaryOp, Op, UnaryOp};
use crate::trace::{ParamSpec, Traced};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    /// torch.optim.AdamW semantics: bias correction, decoupled weight decay.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// Plain SGD with L2 weight decay.
    Sgd { weight_decay: f64 },
}

impl Optimizer {
    /// torch.optim.AdamW defaults, with the weight decay torchtitan uses for Llama.
    pub fn adamw_default() -> Self {
        Optimizer::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    /// Names of the per-parameter state tensors this optimizer keeps.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Optimizer::AdamW { .. } => &["m", "v"],
            Optimizer::Sgd { .. } => &[],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    pub optimizer: Optimizer,
    /// Clip the global gradient norm to this value (torch.nn.utils.clip_grad_norm_).
    pub max_grad_norm: Option<f64>,
    /// Micro-batches the step's batch is split into, run one after another with their
    /// gradients summed before the update (gradient accumulation, `micro_batches.rs`); 1: the
    /// step is not split. The forward is traced at the micro-batch's size.
    #[serde(default = "one")]
    pub micro_batches: u32,
}

fn one() -> u32 {
    1
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            optimizer: Optimizer::adamw_default(),
            max_grad_norm: None,
            micro_batches: 1,
        }
    }
}

/// A complete train-step graph and its parameters (ids refer to the returned graph).
#[derive(Clone, Debug)]
pub struct TrainStep {
    pub graph: Graph,
    pub params: Vec<ParamSpec>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum BuildError {
    MissingLoss(String),
    Autodiff(AutodiffError),
    Type(crate::graph::TypeError),
    /// The step cannot be split into the micro-batches asked for.
    MicroBatches(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::MissingLoss(name) => {
                write!(f, "the traced graph has no output named `{name}`")
            }
            BuildError::Autodiff(e) => write!(f, "autodiff: {e}"),
            BuildError::Type(e) => write!(f, "optimizer: {e}"),
            BuildError::MicroBatches(message) => write!(f, "micro-batches: {message}"),
        }
    }
}

impl std::error::Error for BuildError {}

impl From<AutodiffError> for BuildError {
    fn from(e: AutodiffError) -> Self {
        BuildError::Autodiff(e)
    }
}

impl From<crate::graph::TypeError> for BuildError {
    fn from(e: crate::graph::TypeError) -> Self {
        BuildError::Type(e)
    }
}

/// Name of the optimizer-state input `kind` (`m`, `v`) for parameter `param`.
pub fn state_name(kind: &str, param: &str) -> String {
    format!("opt.{kind}.{param}")
}

/// How the ranks of an SPMD train step combine what each computes (passes' `parallelize` builds
/// one from its plan). Each rank differentiates its own local loss; these say what to add.
pub trait RankReductions {
    /// The cotangent each rank's backward pass starts from (1 / the number of ranks the loss is
    /// averaged over).
    fn seed(&self) -> f64;
    /// The mesh dimensions (and the number of ranks along them) over which the loss is
    /// replicated while the work under it is split (tensor parallelism): the seed is made
    /// partial over them, so that gradients sum over those ranks as they do over data ranks.
    fn seed_partial(&self) -> Option<(Vec<usize>, usize)> {
        None
    }
    /// The gradient the update of parameter `index` (in `Traced::params` order) uses, from the
    /// one the rank's backward pass computed: reductions over the mesh dimensions where the
    /// parameter is replicated but its gradient partial.
    fn reduce_grad(
        &self,
        g: &mut Graph,
        index: usize,
        grad: ValueId,
        meta: &Meta,
    ) -> Result<ValueId, TypeError>;
    /// The global sum of all squared gradients from this rank's per-parameter sums.
    fn square_sum(
        &self,
        g: &mut Graph,
        sums: &[ValueId],
        meta: &Meta,
    ) -> Result<ValueId, TypeError>;
    /// The loss the step outputs, from the rank's local loss.
    fn report_loss(&self, g: &mut Graph, loss: ValueId, meta: &Meta) -> Result<ValueId, TypeError>;
}

/// Appends backward and optimizer to a traced forward graph whose output `loss_output` is the loss.
pub fn build_train_step(
    traced: Traced,
    loss_output: &str,
    cfg: &OptimConfig,
) -> Result<TrainStep, BuildError> {
    build_train_step_with(traced, loss_output, cfg, None)
}

/// `build_train_step` for a graph whose ranks combine their work through `ranks` (none: one
/// device).
pub fn build_train_step_with(
    traced: Traced,
    loss_output: &str,
    cfg: &OptimConfig,
    ranks: Option<&dyn RankReductions>,
) -> Result<TrainStep, BuildError> {
    let mut g = traced.graph;
    let loss = g
        .output_named(loss_output)
        .ok_or_else(|| BuildError::MissingLoss(loss_output.to_string()))?
        .value;
    g.outputs.clear();
    let params: Vec<ValueId> = traced.params.iter().map(|p| p.value).collect();
    let (mut g, mut loss, mut grads) = if cfg.micro_batches > 1 {
        micro_batches::forward_and_backward(
            g,
            loss,
            &params,
            cfg.micro_batches,
            ranks.map_or(1.0, |r| r.seed()),
            ranks.and_then(|r| r.seed_partial()),
        )?
    } else {
        let opts = GradOptions {
            seed: ranks.map(|r| r.seed()),
            seed_partial: ranks.and_then(|r| r.seed_partial()),
            ..GradOptions::default()
        };
        let grads = grad_with(&mut g, loss, &params, &opts)?;
        (g, loss, grads)
    };
    let split_end = g.nodes.len();
    if let Some(r) = ranks {
        let meta = Meta::new("optim.reduce_grads", Phase::Backward);
        for (i, gr) in grads.iter_mut().enumerate() {
            *gr = r.reduce_grad(&mut g, i, *gr, &meta)?;
        }
        loss = r.report_loss(&mut g, loss, &Meta::new("optim.loss", Phase::Backward))?;
    }
    // The summed gradients' reductions run once, after the last micro-batch's backward.
    if cfg.micro_batches > 1 {
        for node in &mut g.nodes[split_end..] {
            node.meta.micro_batch = Some(cfg.micro_batches - 1);
        }
    }

    let scalar_dtype = traced
        .params
        .first()
        .map(|p| g.ty(p.value).dtype)
        .unwrap_or(DType::F32);
    let lr = g.add_input("lr", InputKind::Data, TensorType::scalar(scalar_dtype));
    let step = g.add_input("step", InputKind::Data, TensorType::scalar(scalar_dtype));

    let clip = Meta::new("optim.clip_grad_norm", Phase::Optimizer);
    let grad_norm = match ranks {
        None => global_norm(&mut g, &grads, &clip)?,
        Some(r) => {
            let mut sums = Vec::with_capacity(grads.len());
            for gr in &grads {
                sums.push(square_sum(&mut g, *gr, &clip)?);
            }
            let total = r.square_sum(&mut g, &sums, &clip)?;
            g.push1(Op::Unary(UnaryOp::Sqrt), vec![total], clip.clone())?
        }
    };
    let grads = match cfg.max_grad_norm {
        Some(max_norm) => clip_grads(&mut g, &grads, grad_norm, max_norm, &clip)?,
        None => grads,
    };

    let mut new_params = Vec::new();
    let mut new_states: Vec<Vec<(ValueId, ValueId)>> =
        vec![Vec::new(); cfg.optimizer.state_names().len()];
    for (p, gr) in traced.params.iter().zip(&grads) {
        let ty = g.ty(p.value).clone();
        let meta = Meta::new(p.name.clone(), Phase::Optimizer);
        match cfg.optimizer {
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let m = g.add_input(state_name("m", &p.name), InputKind::State, ty.clone());
                let v = g.add_input(state_name("v", &p.name), InputKind::State, ty);
                let outs = g.push(
                    Op::AdamW {
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                    },
                    vec![p.value, *gr, m, v, lr, step],
                    meta,
                )?;
                new_params.push((p, outs[0]));
                new_states[0].push((m, outs[1]));
                new_states[1].push((v, outs[2]));
            }
            Optimizer::Sgd { weight_decay } => {
                let out = g.push1(Op::Sgd { weight_decay }, vec![p.value, *gr, lr], meta)?;
                new_params.push((p, out));
            }
        }
    }

    g.add_output("loss", loss, None);
    g.add_output("grad_norm", grad_norm, None);
    for (p, new) in &new_params {
        g.add_output(p.name.clone(), *new, Some(p.value));
    }
    for states in &new_states {
        for (old, new) in states {
            let name = g
                .inputs
                .iter()
                .find(|i| i.value == *old)
                .map(|i| i.name.clone())
                .unwrap_or_default();
            g.add_output(name, *new, Some(*old));
        }
    }

    let graph = g.canonical();
    let params = traced
        .params
        .into_iter()
        .map(|p| {
            let value = graph
                .input_named(&p.name)
                .map(|i| i.value)
                .unwrap_or(p.value);
            ParamSpec { value, ..p }
        })
        .collect();
    Ok(TrainStep { graph, params })
}

/// Σ g² of one gradient, as a scalar.
fn square_sum(g: &mut Graph, gr: ValueId, meta: &Meta) -> Result<ValueId, TypeError> {
    let rank = g.ty(gr).rank();
    let sq = g.push1(Op::Unary(UnaryOp::Square), vec![gr], meta.clone())?;
    g.push1(
        Op::ReduceSum {
            axes: (0..rank).collect(),
            keepdim: false,
        },
        vec![sq],
        meta.clone(),
    )
}

/// sqrt(Σ_p Σ g_p²) as a scalar.
fn global_norm(g: &mut Graph, grads: &[ValueId], meta: &Meta) -> Result<ValueId, BuildError> {
    let mut total: Option<ValueId> = None;
    for gr in grads {
        let rank = g.ty(*gr).rank();
        let sq = g.push1(Op::Unary(UnaryOp::Square), vec![*gr], meta.clone())?;
        let s = g.push1(
            Op::ReduceSum {
                axes: (0..rank).collect(),
                keepdim: false,
            },
            vec![sq],
            meta.clone(),
        )?;
        total = Some(match total {
            None => s,
            Some(t) => g.push1(Op::Binary(BinaryOp::Add), vec![t, s], meta.clone())?,
        });
    }
    let total = match total {
        Some(t) => t,
        None => g.push1(
            Op::Full {
                value: 0.0,
                shape: vec![],
                dtype: DType::F32,
            },
            vec![],
            meta.clone(),
        )?,
    };
    Ok(g.push1(Op::Unary(UnaryOp::Sqrt), vec![total], meta.clone())?)
}

/// g * min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
fn clip_grads(
    g: &mut Graph,
    grads: &[ValueId],
    norm: ValueId,
    max_norm: f64,
    meta: &Meta,
) -> Result<Vec<ValueId>, BuildError> {
    let dtype = g.ty(norm).dtype;
    let full = |value| Op::Full {
        value,
        shape: vec![],
        dtype,
    };
    let max = g.push1(full(max_norm), vec![], meta.clone())?;
    let one = g.push1(full(1.0), vec![], meta.clone())?;
    let denom = g.push1(Op::AddScalar { value: 1e-6 }, vec![norm], meta.clone())?;
    let ratio = g.push1(Op::Binary(BinaryOp::Div), vec![max, denom], meta.clone())?;
    let scale = g.push1(Op::Binary(BinaryOp::Min), vec![ratio, one], meta.clone())?;
    let mut out = Vec::with_capacity(grads.len());
    for gr in grads {
        let shape = g.ty(*gr).shape.clone();
        let s = g.push1(
            Op::Reshape {
                shape: vec![1; shape.len()],
            },
            vec![scale],
            meta.clone(),
        )?;
        let s = g.push1(Op::Expand { shape }, vec![s], meta.clone())?;
        out.push(g.push1(Op::Binary(BinaryOp::Mul), vec![*gr, s], meta.clone())?);
    }
    Ok(out)
}
