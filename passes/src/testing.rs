//! The snapshot-test helper for pass authors.
//!
//! `check(pass, input_text)` parses and verifies the input, runs the pass, verifies its output,
//! then runs both graphs on the same seeded random inputs through the reference interpreter and
//! compares every output by name: bitwise for a tier-1 pass, within a tolerance for tier 2. Only
//! then does it return the text to snapshot (the pass report as `//` comments, then the graph),
//! so a snapshot can never bless a wrong rewrite.
//!
//! The inputs are valid training states where the graph is a train step (`random_inputs`: a
//! positive learning rate, a positive step count, non-negative second moments, parameters and
//! moments of a realistic size), so that whole-step comparisons compare real numbers. A NaN or
//! an infinity in any output, on either side, fails the comparison: it is never "equal".

use crate::pass::{Pass, PassReport, Tier};
use graphtrain_ir::interp::{run_ranks, HostTensor};
use graphtrain_ir::optim::state_name;
use graphtrain_ir::{rng, text, verify, DType, Graph, InputKind, Op, Placement, ValueId};
use std::fmt;

/// Relative tolerance for tier-2 passes, by dtype.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-9,
        DType::BF16 => 2e-2,
        _ => 1e-4,
    }
}

/// The smallest positive normal number of `dtype`: the floor of the tier-2 scale of a tensor
/// that is all zeros (bf16 has f32's exponent range).
fn smallest_normal(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::MIN_POSITIVE,
        _ => f32::MIN_POSITIVE as f64,
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct CheckError(pub String);

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CheckError {}

/// A pass run that passed the numerics check.
#[derive(Clone, Debug)]
pub struct Checked {
    pub graph: Graph,
    pub report: PassReport,
    /// The snapshot text: report lines as `//` comments, then the rewritten graph.
    pub text: String,
}

/// Runs `pass` on `input` and checks numerics; panics with the reason on failure (for tests).
pub fn check(pass: &dyn Pass, input: &str) -> String {
    match try_check(pass, input) {
        Ok(c) => c.text,
        Err(e) => panic!("{e}"),
    }
}

/// Like `check`, but returns the failure instead of panicking.
pub fn try_check(pass: &dyn Pass, input: &str) -> Result<Checked, CheckError> {
    let before =
        text::parse(input).map_err(|e| CheckError(format!("input does not parse: {e}")))?;
    verify(&before).map_err(|e| CheckError(format!("input does not verify: {e}")))?;
    let (after, report) = pass.run(&before).map_err(|e| CheckError(e.to_string()))?;
    verify(&after)
        .map_err(|e| CheckError(format!("pass `{}` left an invalid graph: {e}", pass.name())))?;
    compare_numerics(&before, &after, pass.tier(), 3)
        .map_err(|e| CheckError(format!("pass `{}` changed the numbers: {e}", pass.name())))?;
    let mut out = String::new();
    for line in report.to_string().lines() {
        out.push_str("// ");
        out.push_str(line);
        out.push('\n');
    }
    out.push_str(&text::print(&after));
    Ok(Checked {
        graph: after,
        report,
        text: out,
    })
}

/// What a successful `compare_numerics_counted` compared: every element it counts was finite on
/// both sides and passed the tier's rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compared {
    pub trials: u64,
    /// Outputs compared per trial.
    pub outputs: usize,
    /// Elements compared, over all outputs and trials.
    pub elements: usize,
}

/// Runs `before` and `after` on `trials` sets of seeded inputs (`random_inputs` of `before`) and
/// compares their outputs by name with `compare_tensors`: bitwise for `Tier::Preserving`, within
/// a relative tolerance scaled to each tensor otherwise. A NaN or an infinity in any output of
/// either graph is a failure.
pub fn compare_numerics(
    before: &Graph,
    after: &Graph,
    tier: Tier,
    trials: u64,
) -> Result<(), String> {
    compare_numerics_counted(before, after, tier, trials).map(|_| ())
}

/// `compare_numerics`, returning how much it compared.
pub fn compare_numerics_counted(
    before: &Graph,
    after: &Graph,
    tier: Tier,
    trials: u64,
) -> Result<Compared, String> {
    if trials == 0 {
        return Err("no trials: nothing would be compared".into());
    }
    if before.inputs.len() != after.inputs.len()
        || before
            .inputs
            .iter()
            .zip(&after.inputs)
            .any(|(a, b)| a.name != b.name || before.ty(a.value) != after.ty(b.value))
    {
        return Err("the graph inputs changed (names, order or types)".into());
    }
    let names_before: Vec<&str> = before.outputs.iter().map(|o| o.name.as_str()).collect();
    let names_after: Vec<&str> = after.outputs.iter().map(|o| o.name.as_str()).collect();
    if names_before != names_after {
        return Err(format!(
            "the outputs changed: {} {names_before:?} -> {} {names_after:?}",
            names_before.len(),
            names_after.len()
        ));
    }
    let mut compared = Compared {
        trials,
        outputs: names_before.len(),
        elements: 0,
    };
    if before.mesh != after.mesh {
        return Err("the mesh changed".into());
    }
    for seed in 0..trials {
        let inputs = rank_inputs(before, seed);
        let refs: Vec<&[HostTensor]> = inputs.iter().map(|v| v.as_slice()).collect();
        let a =
            run_ranks(before, &refs).map_err(|e| format!("the input graph fails to run: {e}"))?;
        let b = run_ranks(after, &refs)
            .map_err(|e| format!("the rewritten graph fails to run: {e}"))?;
        for (rank, (a, b)) in a.iter().zip(&b).enumerate() {
            for (which, got) in [("input", a.outputs.len()), ("rewritten", b.outputs.len())] {
                if got != names_before.len() {
                    return Err(format!(
                        "the {which} graph returned {got} outputs for {} declared",
                        names_before.len()
                    ));
                }
            }
            let on = if inputs.len() == 1 {
                String::new()
            } else {
                format!(" on rank {rank}")
            };
            for ((name, x), y) in names_before.iter().zip(&a.outputs).zip(&b.outputs) {
                compared.elements += compare_tensors(name, x, y, tier)
                    .map_err(|e| format!("{e}{on} on seed {seed} ({})", tier.label()))?;
            }
        }
    }
    Ok(compared)
}

/// Every rank's inputs for trial `seed`: one rank's `random_inputs` for a graph without a mesh;
/// with one, inputs replicated along a mesh dimension are the same on the ranks along it, and
/// differ (another seed) where they are sharded or their placement is not declared.
fn rank_inputs(g: &Graph, seed: u64) -> Vec<Vec<HostTensor>> {
    let Some(mesh) = &g.mesh else {
        return vec![random_inputs(g, seed)];
    };
    let world = mesh.world_size() as u64;
    let per_source: Vec<Vec<HostTensor>> = (0..world)
        .map(|r| random_inputs(g, seed * world + r))
        .collect();
    (0..mesh.world_size())
        .map(|rank| {
            g.inputs
                .iter()
                .enumerate()
                .map(|(i, input)| {
                    let mut coords = mesh.coords(rank);
                    if let Some(p) = &input.placement {
                        for (c, q) in coords.iter_mut().zip(&p.0) {
                            if *q == Placement::Replicate {
                                *c = 0;
                            }
                        }
                    }
                    per_source[mesh.rank_of(&coords)][i].clone()
                })
                .collect()
        })
        .collect()
}

/// Compares one output, `before` (the reference) against `after`, and returns the number of
/// elements compared. Fails on a type or element-count difference, on a NaN or an infinity on
/// either side (never equal, not even to itself), and on the first element that breaks the
/// tier's rule, naming the output, the element (flat and multi-dimensional index) and both
/// values:
/// - tier 1 (`Tier::Preserving`): the same bits;
/// - tier 2 (`Tier::Changing`): `|a - b| <= tol * max(|a|, |b|, rms)`, where `tol` is the
///   dtype's relative tolerance (1e-4 for f32, 2e-2 for bf16, 1e-9 for f64) and `rms` the root
///   mean square of `before` (at least the dtype's smallest normal): each element is held to
///   its own magnitude, and elements near zero to the tensor's scale, whatever that scale is
///   (AdamW second moments near 1e-8 are compared as closely as logits near 1).
pub fn compare_tensors(
    name: &str,
    before: &HostTensor,
    after: &HostTensor,
    tier: Tier,
) -> Result<usize, String> {
    if before.ty != after.ty {
        return Err(format!(
            "output `{name}` changed type: {} -> {}",
            before.ty, after.ty
        ));
    }
    let numel = before.ty.numel();
    if before.data.len() != numel || after.data.len() != numel {
        return Err(format!(
            "output `{name}` ({}) has {} elements before and {} after",
            before.ty,
            before.data.len(),
            after.data.len()
        ));
    }
    let at = |i: usize| element_at(&before.ty.shape, i);
    for (i, (p, q)) in before.data.iter().zip(&after.data).enumerate() {
        if !p.is_finite() || !q.is_finite() {
            return Err(format!(
                "output `{name}` element {i}{} is not finite: {p:e} before, {q:e} after \
                 (a NaN or an infinity never compares equal)",
                at(i)
            ));
        }
    }
    let rms = if numel == 0 {
        0.0
    } else {
        (before.data.iter().map(|p| p * p).sum::<f64>() / numel as f64).sqrt()
    };
    let floor = rms.max(smallest_normal(before.ty.dtype));
    let tol = tolerance(before.ty.dtype);
    for (i, (p, q)) in before.data.iter().zip(&after.data).enumerate() {
        match tier {
            Tier::Preserving => {
                if p.to_bits() != q.to_bits() {
                    return Err(format!(
                        "output `{name}` element {i}{} differs: {p:e} before, {q:e} after",
                        at(i)
                    ));
                }
            }
            Tier::Changing => {
                let bound = tol * p.abs().max(q.abs()).max(floor);
                let diff = (p - q).abs();
                if diff > bound {
                    return Err(format!(
                        "output `{name}` element {i}{} differs: {p:e} before, {q:e} after \
                         (|difference| {diff:e} > {tol:e} x max(|before|, |after|, rms {rms:e}) \
                         = {bound:e})",
                        at(i)
                    ));
                }
            }
        }
    }
    Ok(numel)
}

/// ` at [i, j, ..]`: the multi-dimensional index of flat element `i` (empty for scalars).
fn element_at(shape: &[usize], mut i: usize) -> String {
    if shape.is_empty() {
        return String::new();
    }
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = i % n;
            i /= n;
        }
    }
    format!(" at {idx:?}")
}

/// Standard deviation of parameters of rank 2 and more (as `Init::Normal { std: 0.02 }`).
const PARAM_STD: f64 = 0.02;
/// Standard deviation of AdamW first moments (the size of the `tiny` step's gradients).
const FIRST_MOMENT_STD: f64 = 1e-3;
/// Second moments are squares of normal draws with this standard deviation.
const SECOND_MOMENT_ROOT_STD: f64 = 1e-2;

/// What an input holds, which decides how `random_inputs` draws it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    /// Integer ids, indices or targets in `0..bound`.
    Index(u64),
    Bool,
    LearningRate,
    StepCount,
    FirstMoment,
    SecondMoment,
    /// A float that a `log`, `sqrt` or `rsqrt` reads directly.
    Positive,
    /// A rank-0 or rank-1 parameter (a norm scale).
    Scale,
    /// A parameter of rank 2 or more (a weight or an embedding).
    Weight,
    Normal,
}

/// Seeded inputs for every graph input, valid training states where the graph is a train step.
/// Input `k` draws from stream `k` under `seed`; the first rule that applies decides its values:
///
/// 1. integers: in range for the ids, indices and targets they feed (`tokens` and `targets` of
///    a train step in `0..vocab`), `0..4` where nothing bounds them;
/// 2. bools: random;
/// 3. the learning rate, a float scalar data input named `lr` (as the trainer feeds it) or read
///    as the learning rate by `adamw` or `sgd`: uniform in `[1e-3, 4e-3)`;
/// 4. the step count, a float scalar data input named `step` or read as the step by `adamw`: a
///    whole number in `1..=8`;
/// 5. AdamW first moments, state inputs named `opt.m.*` or read as `m` by `adamw`: N(0, 1e-3²),
///    the size of the gradients of the `tiny` step;
/// 6. AdamW second moments, state inputs named `opt.v.*` or read as `v` by `adamw`: squares of
///    N(0, 1e-2²) draws (non-negative, around 1e-4, some near 1e-8);
/// 7. floats that a `log`, `sqrt` or `rsqrt` reads directly: uniform in `[0.5, 2)`;
/// 8. parameters (`param` inputs) of rank 0 or 1 (norm scales): `1 + N(0, 0.02²)`; of rank 2
///    or more (weights, embeddings): N(0, 0.02²), as the models initialize them;
/// 9. any other float: N(0, 1).
///
/// A graph without parameters, optimizer state or inputs named `lr` and `step`, and without an
/// `adamw` or `sgd` node, gets exactly what it got before these rules existed (rules 1, 2, 7
/// and 9).
pub fn random_inputs(g: &Graph, seed: u64) -> Vec<HostTensor> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(k, input)| {
            let ty = g.ty(input.value).clone();
            let stream = k as u64;
            let normal = |i: usize| rng::normal(seed, stream, i as u64);
            match role(g, k) {
                Role::Index(bound) => {
                    HostTensor::from_fn(ty, |i| rng::below(seed, stream, i as u64, bound) as f64)
                }
                Role::Bool => {
                    HostTensor::from_fn(ty, |i| rng::below(seed, stream, i as u64, 2) as f64)
                }
                Role::LearningRate => HostTensor::from_fn(ty, |i| {
                    1e-3 * (1.0 + 3.0 * rng::uniform(seed, stream, i as u64))
                }),
                Role::StepCount => {
                    HostTensor::from_fn(ty, |i| 1.0 + rng::below(seed, stream, i as u64, 8) as f64)
                }
                Role::FirstMoment => HostTensor::from_fn(ty, |i| FIRST_MOMENT_STD * normal(i)),
                Role::SecondMoment => HostTensor::from_fn(ty, |i| {
                    let r = SECOND_MOMENT_ROOT_STD * normal(i);
                    r * r
                }),
                Role::Positive => {
                    HostTensor::from_fn(ty, |i| 0.5 + 1.5 * rng::uniform(seed, stream, i as u64))
                }
                Role::Scale => HostTensor::from_fn(ty, |i| 1.0 + PARAM_STD * normal(i)),
                Role::Weight => HostTensor::from_fn(ty, |i| PARAM_STD * normal(i)),
                Role::Normal => HostTensor::from_fn(ty, normal),
            }
        })
        .collect()
}

/// The role of input `k` of `g` (the rules of `random_inputs`, in order).
fn role(g: &Graph, k: usize) -> Role {
    let input = &g.inputs[k];
    let v = input.value;
    let ty = g.ty(v);
    if ty.dtype.is_int() {
        return Role::Index(index_bound(g, v).unwrap_or(4).max(1) as u64);
    }
    if ty.dtype == DType::Bool {
        return Role::Bool;
    }
    let data_scalar = input.kind == InputKind::Data && ty.rank() == 0;
    let state = input.kind == InputKind::State;
    let m_prefix = state_name("m", "");
    let v_prefix = state_name("v", "");
    if (data_scalar && input.name == "lr") || read_as(g, v, OptimOperand::LearningRate) {
        Role::LearningRate
    } else if (data_scalar && input.name == "step") || read_as(g, v, OptimOperand::Step) {
        Role::StepCount
    } else if (state && input.name.starts_with(&m_prefix))
        || read_as(g, v, OptimOperand::FirstMoment)
    {
        Role::FirstMoment
    } else if (state && input.name.starts_with(&v_prefix))
        || read_as(g, v, OptimOperand::SecondMoment)
    {
        Role::SecondMoment
    } else if feeds_positive_only(g, v) {
        Role::Positive
    } else if input.kind == InputKind::Param {
        if ty.rank() <= 1 {
            Role::Scale
        } else {
            Role::Weight
        }
    } else {
        Role::Normal
    }
}

#[derive(Clone, Copy, PartialEq)]
enum OptimOperand {
    LearningRate,
    Step,
    FirstMoment,
    SecondMoment,
}

/// Whether an optimizer node reads `v` as `operand` (`adamw(p, g, m, v, lr, step)`,
/// `sgd(p, g, lr)`).
fn read_as(g: &Graph, v: ValueId, operand: OptimOperand) -> bool {
    g.nodes.iter().any(|n| {
        let pos = match (&n.op, operand) {
            (Op::AdamW { .. }, OptimOperand::FirstMoment) => 2,
            (Op::AdamW { .. }, OptimOperand::SecondMoment) => 3,
            (Op::AdamW { .. }, OptimOperand::LearningRate) => 4,
            (Op::AdamW { .. }, OptimOperand::Step) => 5,
            (Op::Sgd { .. }, OptimOperand::LearningRate) => 2,
            _ => return false,
        };
        n.inputs.get(pos) == Some(&v)
    })
}

/// The smallest index range among the ops that read `v` as ids, indices or targets.
fn index_bound(g: &Graph, v: ValueId) -> Option<usize> {
    let mut bound: Option<usize> = None;
    for n in &g.nodes {
        for (pos, input) in n.inputs.iter().enumerate() {
            if *input != v {
                continue;
            }
            let limit = match (&n.op, pos) {
                (Op::Embedding, 1) => Some(g.ty(n.inputs[0]).shape[0]),
                (Op::EmbeddingBackward { rows }, 1) => Some(*rows),
                (Op::Gather { axis }, 1) | (Op::ScatterAdd { axis }, 1) => {
                    Some(g.ty(n.inputs[0]).shape[*axis])
                }
                (Op::CrossEntropy | Op::CrossEntropyBackward, 1) => {
                    Some(g.ty(n.inputs[0]).shape[1])
                }
                // Reshapes and casts pass ids through; follow them one level.
                (Op::Reshape { .. } | Op::Cast { .. }, 0) => index_bound(g, n.outputs[0]),
                _ => None,
            };
            if let Some(l) = limit {
                bound = Some(bound.map_or(l, |b| b.min(l)));
            }
        }
    }
    bound
}

fn feeds_positive_only(g: &Graph, v: ValueId) -> bool {
    use graphtrain_ir::UnaryOp::{Log, Rsqrt, Sqrt};
    g.nodes.iter().any(|n| {
        n.inputs.first() == Some(&v)
            && matches!(n.op, Op::Unary(Log) | Op::Unary(Sqrt) | Op::Unary(Rsqrt))
    })
}
