//! The capture pass's regions recorded as device graphs and replayed, as the cpu backend replays
//! them as bound launches (`cpu/replay.rs`). cubecl records the launches of a window on the
//! client's stream into a graph: a CUDA graph on `cuda` (one driver call replays the window), a
//! software graph on `wgpu` (its dispatches resolved once: pipelines, bindings, metadata).
//!
//! What is recorded: a segment, a run of at least two consecutive steps of one capture region
//! whose every step is launches alone (`recordable`): no host read or write in it, and no
//! launch argument that changes between runs. Gather, scatter-add and cross-entropy read their
//! index checks back, so they are recordable only where the host checks their indices as it
//! writes them (`index_checks.rs`); AdamW is where its step count is an input the host writes
//! (its bias corrections are then written at the start of the run, and its launches read them
//! from the arena). The first run dispatches everything. In the second, a segment's
//! dispatch (the run's work) is cubecl's warmup window, after which its launches are issued
//! again into the recording (recorded, not run); later runs replay it. A run that is profiled
//! or timed dispatches every step (they wait for each).
//!
//! Guarantees: a replay runs the recorded launches, the same kernels with the same arguments
//! over the same arena, so a run with graphs is bitwise one without (tested on lavapipe's
//! software graphs; CUDA graphs have not run on a GPU here: `scripts/gpu-check.sh` checks). The
//! arena lives as long as the executor, inputs are written on the recording thread's stream
//! before a replay is queued behind them, and a replay from another thread (another stream) is
//! refused: that run dispatches instead.
//!
//! Declines: a device whose cubecl server has no graph support, or a window cubecl refuses,
//! leaves the segment dispatched from then on, with the reason logged once.

use graphtrain_ir::ValueId;
use graphtrain_lowering::{Program, Step};
use std::collections::HashSet;
use std::ops::Range;

/// A segment and where it stands.
pub(super) struct Segment {
    pub steps: Range<usize>,
    pub state: State,
}

pub(super) enum State {
    /// Dispatched, to be recorded in the next run that may record.
    Waiting,
    /// Recorded: replayed in place of its steps.
    Recorded(cubecl::client::Graph),
    /// cubecl refused to record it (the reason was logged): dispatched from now on.
    Refused,
}

/// Whether the device executor runs `step` by launches alone, with arguments fixed at load.
pub(super) fn recordable(
    program: &Program,
    i: usize,
    step: &Step,
    checked_on_write: &HashSet<usize>,
) -> bool {
    match step {
        Step::Map { .. }
        | Step::MapReduce { .. }
        | Step::Copy { .. }
        | Step::Reduce { .. }
        | Step::Matmul { .. }
        | Step::Attention { .. }
        | Step::AttentionBackward { .. }
        | Step::Rope { .. } => true,
        Step::AdamW { step: t, .. } => written_by_host(program, *t),
        // Their index checks read a flag back, unless the host checks the indices as it
        // writes them (`index_checks.rs`).
        Step::Gather { .. }
        | Step::ScatterAdd { .. }
        | Step::CrossEntropy { .. }
        | Step::CrossEntropyBackward { .. } => checked_on_write.contains(&i),
        _ => false,
    }
}

/// Whether `v` is a graph input the host writes and no output replaces: during a run it holds
/// what the host last wrote, known before the run starts.
pub(super) fn written_by_host(program: &Program, v: ValueId) -> bool {
    let g = &program.graph;
    g.inputs.iter().any(|i| i.value == v) && !g.outputs.iter().any(|o| o.donates == Some(v))
}

/// The Program's segments: maximal runs of at least two recordable steps of one capture region.
pub(super) fn segments(program: &Program, checked_on_write: &HashSet<usize>) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut start = 0;
    let n = program.steps.len();
    while start < n {
        let region = program.step_regions[start];
        let mut end = start;
        while end < n
            && region.is_some()
            && program.step_regions[end] == region
            && recordable(program, end, &program.steps[end], checked_on_write)
        {
            end += 1;
        }
        if end - start >= 2 {
            out.push(Segment {
                steps: start..end,
                state: State::Waiting,
            });
        }
        start = end.max(start + 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_lowering::{lower, Mode};

    /// Segments follow the regions and stop at a step that is not launches alone: here the
    /// gather (its index check reads back) splits region 0, and its one-step head is left out.
    #[test]
    fn segments_are_runs_of_recordable_steps_in_one_region() {
        let g = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[4,8]
  input %i: i32[3]
  %2: f32[4,8] = exp(%x)  # fwd region=0
  %3: f32[3,8] = gather(%2, %i, axis=0)  # fwd region=0
  %4: f32[3,8] = sin(%3)  # fwd region=0
  %5: f32[8,3] = transpose(%4, perm=[1,0])  # fwd region=0
  %6: f32[8,8] = matmul(%5, %4)  # fwd region=0
  %7: f32[8,8] = neg(%6)  # fwd region=1
  %8: f32[8,8] = sqrt(%7)  # fwd region=1
  output o = %8
}",
        )
        .unwrap();
        let p = lower(&g, Mode::Eager).unwrap();
        let kinds: Vec<(&str, Option<u32>)> = p
            .steps
            .iter()
            .zip(&p.step_regions)
            .map(|(s, r)| (s.kind(), *r))
            .collect();
        let ranges: Vec<Range<usize>> = segments(&p, &HashSet::new())
            .into_iter()
            .map(|s| s.steps)
            .collect();
        // exp | gather | sin, copy (transpose), matmul | neg, sqrt
        assert_eq!(ranges, vec![2..5, 5..7], "{kinds:?}");
    }
}
