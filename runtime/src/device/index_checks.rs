//! Index checks made on the host as an input is written, instead of on the device before the
//! step. A gather, scatter-add or cross-entropy step checks its indices with a kernel whose flag
//! the host reads back before the step runs: a wait for the device in the middle of the run,
//! and a step no device graph can hold. Where the step's indices are the values of a graph
//! input the host writes (directly, or through one copy that reads every element of it: the
//! tokens broadcast for the embedding's gather), the host checks them as it writes the input,
//! and the step reads nothing back.
//!
//! Guarantees: every index such a step reads is an element of the input as the host last wrote
//! it (an input that no output replaces), so an index out of range is refused by the write,
//! before any launch that would read it, naming the step, the value and its position in the
//! input. The test is the device kernel's: a whole number in `0..bound`.
//!
//! Declines: indices computed by the step (any other producer) keep the device check.

use crate::RuntimeError;
use graphtrain_ir::{HostTensor, ValueId};
use graphtrain_lowering::{Program, Step, View};
use std::collections::HashMap;

/// Gather's and scatter-add's index check, as the device check names it.
pub(super) const INDEX: (&str, &str) = ("index", "position");
/// Cross-entropy's target check.
pub(super) const TARGET: (&str, &str) = ("cross-entropy target", "row");

/// A check of an input's values on behalf of step `step`.
pub(super) struct WriteCheck {
    pub step: usize,
    pub bound: usize,
    pub what: (&'static str, &'static str),
}

/// Per input, the checks its writes make.
pub(super) fn plan(program: &Program) -> HashMap<ValueId, Vec<WriteCheck>> {
    let g = &program.graph;
    let written = |v: ValueId| super::graphs::written_by_host(program, v);
    // The input whose every element `view` reads (and nothing else), if there is one.
    let input_of_view =
        |view: &View| (written(view.base) && reads_all(program, view)).then_some(view.base);
    // The input a value's elements all come from: the input itself, or the one copy writing it.
    let input_of = |v: ValueId| -> Option<ValueId> {
        if written(v) {
            return Some(v);
        }
        let mut writers = program.steps.iter().filter(|s| s.outputs().contains(&v));
        match (writers.next(), writers.next()) {
            (Some(Step::Copy { dst, src }), None) if dst.base == v && dst.is_contiguous() => {
                input_of_view(src)
            }
            _ => None,
        }
    };
    let mut checks: HashMap<ValueId, Vec<WriteCheck>> = HashMap::new();
    for (i, step) in program.steps.iter().enumerate() {
        let (input, bound, what) = match step {
            Step::Gather {
                src, index, axis, ..
            }
            | Step::ScatterAdd {
                src, index, axis, ..
            } => (input_of(*index), g.ty(*src).shape[*axis], INDEX),
            Step::CrossEntropy {
                logits, targets, ..
            }
            | Step::CrossEntropyBackward {
                logits, targets, ..
            } => (
                input_of_view(targets).filter(|_| targets.shape.len() == 1),
                logits.shape.get(1).copied().unwrap_or(0),
                TARGET,
            ),
            _ => continue,
        };
        if let Some(input) = input {
            checks.entry(input).or_default().push(WriteCheck {
                step: i,
                bound,
                what,
            });
        }
    }
    checks
}

/// Whether `view` reads every element of its base (in any order, some more than once): its
/// dims that move (non-zero stride), from the smallest stride up, walk the base's elements
/// contiguously from 0.
fn reads_all(program: &Program, view: &View) -> bool {
    let mut moving: Vec<(usize, usize)> = view
        .strides
        .iter()
        .zip(&view.shape)
        .filter(|&(&s, &n)| s != 0 && n > 1)
        .map(|(&s, &n)| (s, n))
        .collect();
    moving.sort_unstable();
    let mut next = 1;
    for (stride, n) in moving {
        if stride != next {
            return false;
        }
        next *= n;
    }
    view.offset == 0 && next == program.graph.ty(view.base).numel()
}

/// Refuses `t`, about to be written, where an index it stands for is out of range.
pub(super) fn check(
    program: &Program,
    checks: &[WriteCheck],
    t: &HostTensor,
) -> Result<(), RuntimeError> {
    for c in checks {
        if let Some((pos, &x)) = t.data.iter().enumerate().find(|&(_, &x)| {
            let x = x as f32;
            !(x >= 0.0 && x < c.bound as f32 && x.floor() == x)
        }) {
            return Err(RuntimeError::Input(format!(
                "step {} ({}): {} {} at {} {pos} is out of range 0..{}",
                c.step,
                program.steps[c.step].kind(),
                c.what.0,
                x as f32,
                c.what.1,
                c.bound
            )));
        }
    }
    Ok(())
}
