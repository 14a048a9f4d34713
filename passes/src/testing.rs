//! The snapshot-test helper for pass authors.
//!
//! `check(pass, input_text)` parses and verifies the input, runs the pass, verifies its output,
//! then runs both graphs on the same seeded random inputs through the reference interpreter and
//! compares every output by name: bitwise for a tier-1 pass, within a tolerance for tier 2. Only
//! then does it return the text to snapshot (the pass report as `//` comments, then the graph),
//! so a snapshot can never bless a wrong rewrite.

use crate::pass::{Pass, PassReport, Tier};
use graphtrain_ir::interp::{run, HostTensor};
use graphtrain_ir::{rng, text, verify, DType, Graph, Op, ValueId};
use std::fmt;

/// Relative tolerance for tier-2 passes, by dtype.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-9,
        DType::BF16 => 2e-2,
        _ => 1e-4,
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

/// Runs `before` and `after` on `trials` sets of seeded random inputs and compares the outputs
/// they share by name: bitwise for `Tier::Preserving`, within a relative tolerance otherwise.
pub fn compare_numerics(
    before: &Graph,
    after: &Graph,
    tier: Tier,
    trials: u64,
) -> Result<(), String> {
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
            "the outputs changed: {names_before:?} -> {names_after:?}"
        ));
    }
    for seed in 0..trials {
        let inputs = random_inputs(before, seed);
        let a = run(before, &inputs).map_err(|e| format!("the input graph fails to run: {e}"))?;
        let b =
            run(after, &inputs).map_err(|e| format!("the rewritten graph fails to run: {e}"))?;
        for ((out, x), y) in before.outputs.iter().zip(&a.outputs).zip(&b.outputs) {
            if x.ty != y.ty {
                return Err(format!(
                    "output `{}` changed type: {} -> {}",
                    out.name, x.ty, y.ty
                ));
            }
            for (i, (p, q)) in x.data.iter().zip(&y.data).enumerate() {
                let same = match tier {
                    Tier::Preserving => p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                    Tier::Changing => {
                        (p.is_nan() && q.is_nan())
                            || p == q
                            || (p - q).abs() <= tolerance(x.ty.dtype) * (1.0 + p.abs().max(q.abs()))
                    }
                };
                if !same {
                    return Err(format!(
                        "output `{}` element {i} differs on seed {seed}: {p:e} before, {q:e} after ({})",
                        out.name,
                        tier.label()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Seeded inputs for every graph input: floats N(0, 1) (positive where they feed `log`, `sqrt`,
/// `rsqrt`), integers in range for the ids, indices and targets they feed, bools random.
pub fn random_inputs(g: &Graph, seed: u64) -> Vec<HostTensor> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(k, input)| {
            let ty = g.ty(input.value).clone();
            let stream = k as u64;
            if ty.dtype.is_int() {
                let bound = index_bound(g, input.value).unwrap_or(4).max(1) as u64;
                HostTensor::from_fn(ty, |i| rng::below(seed, stream, i as u64, bound) as f64)
            } else if ty.dtype == DType::Bool {
                HostTensor::from_fn(ty, |i| rng::below(seed, stream, i as u64, 2) as f64)
            } else if feeds_positive_only(g, input.value) {
                HostTensor::from_fn(ty, |i| 0.5 + 1.5 * rng::uniform(seed, stream, i as u64))
            } else {
                HostTensor::from_fn(ty, |i| rng::normal(seed, stream, i as u64))
            }
        })
        .collect()
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
