//! Graph -> Program: the driver of lowering.
//!
//! Takes a verified, legalized train-step graph (the driver, `graphtrain_runtime::compile`,
//! decomposes every composite the backend has no kernel for before it gets here) and:
//! - keeps each composite `keep` accepts as one step. `lower` keeps `kept_composite`'s
//!   (attention and its backward, rope, cross-entropy and its backward, AdamW), which every
//!   backend has kernels for;
//! - folds the values that depend on no input into `constants` (`fold`);
//! - lowers a collective's start and wait to one step each (`Step::CollectiveStart`,
//!   `Step::Wait`, the wait's result in its handle's bytes): the backend's communicator runs
//!   them;
//! - emits steps: one per node (`Mode::Eager`, `eager`), or with layout ops read as views and
//!   elementwise chains fused into one kernel, bounded by `FusionLimits` (`Mode::Fused`,
//!   `fusion`), where consecutive in-place AdamW updates also merge into one step;
//! - lowers `offload` and `reload` to one step each (`Step::Offload`, `Step::Reload`): the
//!   offloaded value lives in host memory (`Program::host_values`), not in the arena;
//! - reads a concat of parameters along their first axis in place (`packs`, fused only): no step,
//!   the parts planned side by side;
//! - plans one arena for every materialized value (`Program::plan_again`), the constants live
//!   for the whole program, parameters and optimizer state updated in place; and records each
//!   step's capture region for the runtime.
//!
//! Guarantees: `Eager` launches one step per unfolded node, each reading and writing whole
//! contiguous buffers; `Fused` runs the same per-element arithmetic in the same order (an
//! inlined producer is the same expression evaluated in a register instead of reloaded; a view
//! only changes where a kernel or the GEMM reads, and the GEMM's summation order does not depend
//! on operand layout; merged AdamW updates touch disjoint bytes), so both give bitwise identical
//! results on one backend: tests/backends.rs and tests/gate.rs check it. The default limits
//! give the same Program as before they were options.
//!
//! Declines (`LowerError`, naming the node where there is one): `FusionLimits` out of range; a
//! composite `keep` refuses (the graph was not legalized); a graph input or an unfolded node producing a dtype
//! other than f32, i32 or bool; an integer constant or `iota` beyond 2^24, which the f32
//! storage cannot hold exactly (`MAX_EXACT_INT`); constants the interpreter cannot evaluate; a
//! node with no step (see `eager`).

use crate::buffer_plan::BufferPlan;
use crate::eager::eager_steps;
use crate::fold::fold_constants;
use crate::fusion::{fused_steps, FusionLimits};
use crate::packs::find_packs;
use crate::program::{
    kept_composite, AdamWUpdate, LowerError, Mode, Program, Step, ELEM_BYTES, MAX_EXACT_INT,
};
use graphtrain_ir::{DType, Graph, Op, ValueId};

/// Lowers a verified train-step graph, keeping the composites `kept_composite` names.
pub fn lower(g: &Graph, mode: Mode) -> Result<Program, LowerError> {
    lower_with(g, mode, &kept_composite)
}

/// Lowers a verified, legalized train-step graph, keeping the composites `keep` accepts as one
/// step each and refusing any other (a backend without a kernel for a composite passes a `keep`
/// that refuses it, and the driver decomposes it before lowering).
pub fn lower_with(
    g: &Graph,
    mode: Mode,
    keep: &dyn Fn(&Op) -> bool,
) -> Result<Program, LowerError> {
    lower_with_limits(g, mode, keep, &FusionLimits::default())
}

/// As `lower_with`, with each fused kernel bounded by `limits` instead of the defaults (eager
/// lowering has no fused kernels; the limits are validated all the same).
pub fn lower_with_limits(
    g: &Graph,
    mode: Mode,
    keep: &dyn Fn(&Op) -> bool,
    limits: &FusionLimits,
) -> Result<Program, LowerError> {
    limits.validate()?;
    if let Some(k) = g
        .nodes
        .iter()
        .position(|n| n.op.is_composite() && !keep(&n.op))
    {
        return Err(err(
            g,
            k,
            format!(
                "composite `{}` has no kernel here and reached the lowering undecomposed: the \
graph must be legalized first (graphtrain_runtime::legalize decomposes it)",
                g.nodes[k].op.name()
            ),
        ));
    }
    let graph = g.canonical();
    let (folded, constants) = fold_constants(&graph)?;
    check_dtypes(&graph, &folded)?;
    let packs = match mode {
        Mode::Eager => Vec::new(),
        Mode::Fused => find_packs(&graph, ELEM_BYTES),
    };
    let steps = match mode {
        Mode::Eager => eager_steps(&graph, &folded)?,
        Mode::Fused => {
            let mut packed = vec![false; graph.nodes.len()];
            for pack in &packs {
                packed[pack.node] = true;
            }
            merge_adamw(&graph, fused_steps(&graph, &folded, &packed, limits)?)
        }
    };
    // Offloaded values live in host memory: the arena holds no bytes for them.
    let host_values: Vec<ValueId> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Offload { out, .. } => Some(*out),
            _ => None,
        })
        .collect();
    let producers = graph.producers();
    let step_regions = steps
        .iter()
        .map(|s| producers[s.writes().index()].and_then(|n| graph.nodes[n].meta.tags.region))
        .collect();
    let mut program = Program {
        graph,
        steps,
        plan: BufferPlan::default(),
        mode,
        constants,
        step_regions,
        host_values,
        bf16_in_two_bytes: Vec::new(),
        packs,
    };
    program
        .plan_again(None)
        .expect("a plan without windows always places every buffer");
    Ok(program)
}

/// Consecutive AdamW steps with the same scalars and hyperparameters become one when every
/// output replaces its input in place (a donated graph output): then no update writes bytes that
/// another one reads, and all of them can run as one job over every parameter.
fn merge_adamw(g: &Graph, steps: Vec<Step>) -> Vec<Step> {
    let donated: std::collections::HashMap<ValueId, ValueId> = g
        .outputs
        .iter()
        .filter_map(|o| o.donates.map(|d| (o.value, d)))
        .collect();
    let in_place = |u: &AdamWUpdate| {
        [(u.p_out, u.p), (u.m_out, u.m), (u.v_out, u.v)]
            .iter()
            .all(|(out, input)| donated.get(out) == Some(input))
    };
    let mut merged: Vec<Step> = Vec::with_capacity(steps.len());
    for s in steps {
        if let (
            Some(Step::AdamW {
                updates,
                lr,
                step,
                beta1,
                beta2,
                eps,
                weight_decay,
            }),
            Step::AdamW {
                updates: next,
                lr: lr2,
                step: step2,
                beta1: beta1_2,
                beta2: beta2_2,
                eps: eps2,
                weight_decay: wd2,
            },
        ) = (merged.last_mut(), &s)
        {
            let same = (*lr, *step) == (*lr2, *step2)
                && [*beta1, *beta2, *eps, *weight_decay] == [*beta1_2, *beta2_2, *eps2, *wd2];
            if same && updates.iter().all(in_place) && next.iter().all(in_place) {
                updates.extend(next.iter().cloned());
                continue;
            }
        }
        merged.push(s);
    }
    merged
}

pub(crate) fn err(g: &Graph, node: usize, message: String) -> LowerError {
    LowerError {
        node: Some(node),
        module: g.nodes[node].meta.module.clone(),
        message,
    }
}

fn check_dtypes(g: &Graph, folded: &[bool]) -> Result<(), LowerError> {
    let ok = |d: DType| matches!(d, DType::F32 | DType::I32 | DType::Bool);
    for i in &g.inputs {
        let d = g.ty(i.value).dtype;
        if !ok(d) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message: format!(
                    "input `{}` is {d}: the compiled backends support f32, i32 and bool tensors today (bf16/f64/i64 run on --backend reference)",
                    i.name
                ),
            });
        }
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if folded[k] {
            continue;
        }
        for o in &n.outputs {
            let d = g.ty(*o).dtype;
            if d == DType::BF16 {
                // Held as f32 rounded to bf16: what rounds (elementwise ops, matmuls, attention)
                // or only moves bf16 values (layout ops) may produce it.
                // Collectives move bf16 as they are, and round a sum once (the communicators).
                let holds_bf16 = crate::eager::elementwise_expr(g, k).is_some()
                    || matches!(
                        n.op,
                        Op::Matmul
                            | Op::Attention { .. }
                            | Op::AttentionBackward { .. }
                            | Op::CollectiveStart { .. }
                            | Op::Wait
                            | Op::Offload
                            | Op::Reload
                            | Op::Reshape { .. }
                            | Op::Transpose { .. }
                            | Op::Slice { .. }
                            | Op::Expand { .. }
                            | Op::Concat { .. }
                    );
                if holds_bf16 {
                    continue;
                }
                return Err(err(
                    g,
                    k,
                    format!(
                        "{} produces bf16: the compiled backends compute bf16 in elementwise ops, matmuls, attention, layout ops and collectives only (bf16-mixed keeps the rest in f32)",
                        n.op.name()
                    ),
                ));
            }
            if !ok(d) {
                return Err(err(
                    g,
                    k,
                    format!(
                        "{} produces {d}: the compiled backends support f32, i32 and bool tensors, and bf16 from some ops (f64/i64 run on --backend reference)",
                        n.op.name()
                    ),
                ));
            }
        }
        if let Op::Iota { shape, .. } = &n.op {
            if shape.iter().any(|&d| d > MAX_EXACT_INT) {
                return Err(err(g, k, format!("iota over {shape:?} exceeds the exact integer range of the f32 storage (2^24)")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AdamW updates whose outputs replace their inputs in place are one step in fused mode;
    /// one that writes new values (here: the third, not donated) stays its own step. Numerics:
    /// tests/backends.rs (a whole train step against the interpreter and the eager lowering).
    #[test]
    fn in_place_adamw_updates_merge_into_one_step() {
        let mut src = String::from("graph g {\n  input %lr: f32[]\n  input %t: f32[]\n");
        for k in 0..3 {
            for (kind, x) in [
                ("param", "p"),
                ("input", "g"),
                ("state", "m"),
                ("state", "v"),
            ] {
                src += &format!("  {kind} %{x}{k}: f32[5]\n");
            }
        }
        for k in 0..3 {
            src += &format!(
                "  %P{k}: f32[5], %M{k}: f32[5], %V{k}: f32[5] = adamw(%p{k}, %g{k}, %m{k}, %v{k}, \
%lr, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)\n"
            );
        }
        for k in 0..3 {
            let donates = |x: &str| {
                if k < 2 {
                    format!(" donates %{x}{k}")
                } else {
                    String::new()
                }
            };
            for (out, x) in [("P", "p"), ("M", "m"), ("V", "v")] {
                src += &format!("  output {out}{k} = %{out}{k}{}\n", donates(x));
            }
        }
        src += "}";
        let g = graphtrain_ir::text::parse(&src).unwrap();
        graphtrain_ir::verify::verify(&g).unwrap();
        let sizes = |mode| {
            let p = lower(&g, mode).unwrap();
            p.steps
                .iter()
                .map(|s| match s {
                    Step::AdamW { updates, .. } => updates.len(),
                    other => panic!("unexpected step {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(sizes(Mode::Fused), vec![2, 1]);
        assert_eq!(sizes(Mode::Eager), vec![1, 1, 1]);
    }
}
