//! The timeline of one run of a Program: when each step started and how long it took, on which
//! lane, named by the graph node that produces what it writes (op, node index, module path,
//! phase). It is what `graphtrain run --trace-out` writes as a Chrome trace.
//!
//! Guarantees: while recording is off an executor pays one `Option` test per step and nothing
//! else; while it is on, every step is waited for before the clock is read (as the profile
//! does), so a duration is the step's own work, not the launch's queueing, and the run is
//! slower than an unrecorded one. Start times count from the start of the run. On a mesh of
//! threads, each rank's communication thread adds its transfers on a third lane
//! (`COMMUNICATION`), which runs beside compute: overlap is what the lanes show side by side.

use graphtrain_ir::Phase;
use graphtrain_lowering::Program;
use std::time::{Duration, Instant};

/// Where a step ran, as the executor dispatches it. The cpu executor runs cubecl kernels on
/// `KERNELS` and its native code (GEMM, attention, host steps) on `HOST`; a device executor
/// puts every step on its one queue, `KERNELS`.
pub const KERNELS: u32 = 0;
pub const HOST: u32 = 1;
/// A rank's communication thread: each collective from the moment every member had started it
/// until its result was in place (link time included), named by its start node.
pub const COMMUNICATION: u32 = 2;

/// One step of a recorded run.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineEvent {
    /// Index of the step in the Program.
    pub step: usize,
    /// What the step does (`Step::kind`: `map`, `matmul`, `attention`, ...).
    pub kind: &'static str,
    /// The graph node producing the value the step writes, when one does.
    pub node: Option<usize>,
    /// That node's op (`matmul`, `add`, ...), or the step kind where there is no node.
    pub op: String,
    /// That node's module path (`layers.0.attention.wq`); empty where there is none.
    pub module: String,
    pub phase: Option<Phase>,
    pub lane: u32,
    /// Since the run began.
    pub start: Duration,
    pub duration: Duration,
}

impl TimelineEvent {
    /// `module op #node`, with `[kind]` after it when the step is not named like the node
    /// (a matmul step writing a transpose's output): the name a trace viewer shows.
    pub fn label(&self) -> String {
        let node = self.node.map(|n| format!(" #{n}")).unwrap_or_default();
        let kind = if self.kind == self.op {
            String::new()
        } else {
            format!(" [{}]", self.kind)
        };
        if self.module.is_empty() {
            format!("{}{node}{kind}", self.op)
        } else {
            format!("{} {}{node}{kind}", self.module, self.op)
        }
    }
}

/// A recorded run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    pub events: Vec<TimelineEvent>,
    /// Wall time of the whole run, including the final wait.
    pub total: Duration,
}

impl Timeline {
    /// The timeline of `program`'s steps as `(step, lane, start, duration)`, each named by the
    /// node producing what it writes: what a recorded run gives, and what a simulator writes.
    pub fn of_steps(
        program: &Program,
        steps: Vec<(usize, u32, Duration, Duration)>,
        total: Duration,
    ) -> Timeline {
        let g = &program.graph;
        let producers = g.producers();
        let events = steps
            .into_iter()
            .map(|(step, lane, start, duration)| {
                let s = &program.steps[step];
                let node = producers.get(s.writes().index()).copied().flatten();
                let n = node.map(|n| &g.nodes[n]);
                TimelineEvent {
                    step,
                    kind: s.kind(),
                    node,
                    op: n.map_or(s.kind().to_string(), |n| n.op.name().to_string()),
                    module: n.map(|n| n.meta.module.clone()).unwrap_or_default(),
                    phase: n.map(|n| n.meta.phase),
                    lane,
                    start,
                    duration,
                }
            })
            .collect();
        Timeline { events, total }
    }
}

/// Records a run step by step; the executor holds one only while recording is on.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    origin: Option<Instant>,
    /// (step, lane, start, duration); names are resolved once the run is done.
    raw: Vec<(usize, u32, Duration, Duration)>,
    last: Option<Timeline>,
}

impl Recorder {
    /// Starts (`on`) or stops recording into `slot`, keeping a recording already under way.
    pub(crate) fn switch(slot: &mut Option<Recorder>, on: bool) {
        match (on, slot.is_some()) {
            (true, false) => *slot = Some(Recorder::default()),
            (false, true) => *slot = None,
            _ => {}
        }
    }

    /// Marks the start of a run.
    pub(crate) fn begin(&mut self) {
        self.raw.clear();
        self.origin = Some(Instant::now());
    }

    /// Step `step` ran on `lane` from `started` until now (the caller waited for it).
    pub(crate) fn record(&mut self, step: usize, lane: u32, started: Instant) {
        let Some(origin) = self.origin else { return };
        self.raw.push((
            step,
            lane,
            started.saturating_duration_since(origin),
            started.elapsed(),
        ));
    }

    /// The collectives' transfers of this run, on the `COMMUNICATION` lane, each named by the
    /// program step that started it.
    pub(crate) fn transfers(&mut self, transfers: &[crate::comm::Transfer], program: &Program) {
        let Some(origin) = self.origin else { return };
        for t in transfers {
            let step = program.steps.iter().position(|s| {
                matches!(s, graphtrain_lowering::Step::CollectiveStart { handle, .. } if handle.index() == t.id)
            });
            if let Some(step) = step {
                self.raw.push((
                    step,
                    COMMUNICATION,
                    t.met.saturating_duration_since(origin),
                    t.done.saturating_duration_since(t.met),
                ));
            }
        }
    }

    /// Ends the run: the steps recorded since `begin` become the timeline `take` returns.
    pub(crate) fn finish(&mut self, program: &Program) {
        let Some(origin) = self.origin.take() else {
            return;
        };
        let raw = std::mem::take(&mut self.raw);
        self.last = Some(Timeline::of_steps(program, raw, origin.elapsed()));
    }

    pub(crate) fn take(&mut self) -> Option<Timeline> {
        self.last.take()
    }
}
