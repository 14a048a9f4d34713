//! `autoshard --world N`: the solver and the simulator together. Every mesh of `N` ranks the
//! model splits over (`dp_shard` x `tp`, `tp` within a node and dividing the heads), a plan
//! for each from the solver (the fastest by its price, and the fastest that fits the device's
//! memory before any pass, or if none does the smallest it found), every pass pipeline given,
//! each step simulated; ranked by the simulated step among those whose arena fits the device,
//! with the reason for the first.

use super::{Options, Solver};
use crate::sim::hardware::Kind;
use crate::sim::{lower_for, simulate, Prediction};
use graphtrain_ir::mesh::{Mesh, MeshDim};
use graphtrain_passes::parallelize::Plan;
use graphtrain_passes::Pipeline;

/// One simulated candidate: mesh, plan, pipeline and what the simulator says (or why not).
pub struct Row {
    pub mesh: Mesh,
    /// `fastest` (the solver without a limit), `fits` (under the device's memory) or, where
    /// nothing fits before the passes, `smallest` (the least memory the solver found).
    pub plan_kind: &'static str,
    pub plan: Option<Plan>,
    pub passes: String,
    pub outcome: Result<Prediction, String>,
    pub fits: bool,
}

/// The meshes of `world` ranks: `dp_shard` x `tp`, `tp` a divisor of both head counts no
/// larger than the devices of a node, the batch splitting over `dp_shard`.
pub fn meshes(opts: &Options, world: usize) -> Vec<Mesh> {
    let m = &opts.model;
    let per_node = match opts.hardware.kind {
        Kind::Gpu => opts.hardware.gpus_per_node,
        Kind::Cpu => world,
    };
    (1..=world)
        .filter(|tp| {
            world.is_multiple_of(*tp)
                && *tp <= per_node
                && m.n_heads.is_multiple_of(*tp)
                && m.n_kv_heads.is_multiple_of(*tp)
                && m.batch.is_multiple_of(world / tp)
        })
        .map(|tp| Mesh {
            dims: [("dp_shard", world / tp), ("tp", tp)]
                .iter()
                .filter(|(_, size)| *size > 1 || world == 1)
                .map(|(name, size)| MeshDim {
                    name: name.to_string(),
                    size: *size,
                })
                .collect(),
        })
        .collect()
}

/// Solves and simulates every mesh with every pipeline (`pipelines`: name and pipeline).
pub fn survey(
    opts: &Options,
    world: usize,
    pipelines: &[(String, Pipeline)],
    nodes: usize,
) -> Vec<Row> {
    let hw = opts.hardware;
    let device_bytes = hw.memory_per_rank(world);
    let mut rows = Vec::new();
    for mesh in meshes(opts, world) {
        let mut plans: Vec<(&'static str, Result<Plan, String>)> = Vec::new();
        for (kind, limit) in [("fastest", None), ("fits", Some(device_bytes))] {
            let o = Options {
                model: opts.model.clone(),
                mesh: mesh.clone(),
                optim: opts.optim,
                precision: opts.precision,
                hardware: opts.hardware,
                links: opts.links,
                memory_limit: limit,
                fixed: opts.fixed.clone(),
                proposals: opts.proposals,
            };
            let solved = match Solver::new(&o) {
                Ok(solver) => solver.solve_or_smallest(),
                Err(e) => Err((e, None)),
            };
            // Where nothing fits before the passes, the smallest plan: activation
            // checkpointing may make it fit.
            let (kind, plan) = match solved {
                Ok(s) => (kind, Ok(s.plan)),
                Err((_, Some(smallest))) => ("smallest", Ok(smallest)),
                Err((e, None)) => (kind, Err(e)),
            };
            if plans
                .iter()
                .any(|(_, p)| p.is_ok() && p.as_ref().ok() == plan.as_ref().ok())
            {
                continue;
            }
            plans.push((kind, plan));
        }
        for (plan_kind, plan) in plans {
            if let Err(e) = &plan {
                // One row says why: no pipeline can run a plan that does not exist.
                rows.push(Row {
                    mesh: mesh.clone(),
                    plan_kind,
                    plan: None,
                    passes: "-".into(),
                    outcome: Err(e.clone()),
                    fits: false,
                });
                continue;
            }
            for (passes, pipeline) in pipelines {
                let outcome = plan.clone().and_then(|plan| {
                    let step = crate::trainer::build_spmd_step_in(
                        &opts.model,
                        &mesh,
                        &plan,
                        &opts.optim,
                        opts.precision,
                    )
                    .map_err(|e| e.to_string())?;
                    let program = lower_for(&step.step.graph, pipeline, hw)?;
                    simulate(&program, hw, opts.links, nodes)
                });
                let fits = outcome
                    .as_ref()
                    .is_ok_and(|p| p.arena_bytes as f64 <= device_bytes);
                rows.push(Row {
                    mesh: mesh.clone(),
                    plan_kind,
                    plan: plan.as_ref().ok().cloned(),
                    passes: passes.clone(),
                    outcome,
                    fits,
                });
            }
        }
    }
    // Fitting rows first, each group by step time; failures last.
    rows.sort_by(|a, b| {
        let key = |r: &Row| {
            (
                !r.fits,
                r.outcome.as_ref().map_or(f64::INFINITY, |p| p.step_s),
            )
        };
        let (ka, kb) = (key(a), key(b));
        ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
    });
    rows
}
