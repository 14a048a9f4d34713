//! graphtrain's runtime: compiles a train-step graph for a backend and runs it.
//!
//! - `compile` is the one driver: pipeline, legalization, lowering, then `Compiled::load` gives
//!   a loaded `Executor`. The trainer, `bench`, the numerics gate (and the ranks, the simulator
//!   and the search loop after them) get a runnable step only through it;
//! - `Backend` names what `--backend` accepts and says, for one that is not built in or not
//!   present, what is missing and how to get it;
//! - `Executor` is what every backend implements, the interpreter included: write inputs, run
//!   the step, read values back. Parameters and optimizer state stay in the executor between
//!   steps (their outputs are donated to their inputs), so a training loop only writes the batch;
//! - `cpu/` (cubecl-cpu plus host kernels) is the fast compiled backend; `device/` runs the same
//!   Programs on `wgpu` and `cuda`; `shared/` holds what both use (the cubecl kernels and their
//!   launches, the profile); `reference.rs` runs the interpreter;
//! - `options.rs` holds every setting an executor is given (`RuntimeOptions`), and `comm.rs` the
//!   communicator each executor is given (one rank, or a rank of threads in one process);
//! - `ranks.rs` runs every rank of an SPMD graph's mesh as a thread of this process, behind one
//!   `Executor` over global tensors.
//!
//! Architecture invariant: an executor never changes a Program's numerics: the same Program on
//! the same backend gives bitwise identical results every run (no autotuning, fixed summation
//! orders). Nothing here reads the environment: settings come in through `RuntimeOptions`.

pub mod comm;
pub mod compile;
pub mod cpu;
pub mod device;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod options;
pub mod ranks;
pub mod reference;
pub mod shared;
pub mod timeline;

pub use comm::{
    CollectiveCall, Communicator, FakeRank, Link, SingleRank, ThreadComm, ThreadWorld, Transfer,
};
pub use compile::{
    compile, legalize, lower_for_backend, CompileOptions, CompileTimings, Compiled, Fingerprint,
};
pub use options::{
    DeviceCollectives, DeviceGraphs, DeviceMatmul, GemmKernel, MapVector, Profile, RuntimeOptions,
};
pub use ranks::{global_type, ThreadRanks};
pub use reference::ReferenceExecutor;
pub use timeline::{Timeline, TimelineEvent};

use graphtrain_ir::{Graph, HostTensor, Op, ValueId};
use graphtrain_lowering::{kept_composite, Mode, Program};
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The reference interpreter (f64 math rounded to each dtype): slow, the oracle for tests.
    Reference,
    /// cubecl-cpu: kernels JIT-compiled through LLVM, plus a native GEMM.
    Cpu,
    /// cubecl-wgpu (Vulkan/Metal/DX12; lavapipe on a machine without a GPU), with the
    /// `wgpu` feature (on by default). Correct, not yet fast.
    Wgpu,
    /// cubecl-cuda, with the `cuda` feature. Built in CI, not yet run.
    Cuda,
}

impl Backend {
    pub const ALL: [Backend; 4] = [
        Backend::Cpu,
        Backend::Reference,
        Backend::Wgpu,
        Backend::Cuda,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::Cpu => "cpu",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
        }
    }

    /// Why this backend cannot run here, if it cannot: not compiled in, or no device present.
    pub fn unavailable(self) -> Option<String> {
        match self {
            Backend::Reference | Backend::Cpu => None,
            Backend::Wgpu => device::DeviceKind::Wgpu
                .device()
                .err()
                .map(|e| e.to_string()),
            Backend::Cuda => device::DeviceKind::Cuda
                .device()
                .err()
                .map(|e| e.to_string()),
        }
    }

    /// Whether a Program for this backend keeps composite `op` as one step. Every backend keeps
    /// the composites `kept_composite` names: the cpu backend runs them as host steps, the
    /// device backends as `device_composites.rs` kernels. A backend without such a kernel
    /// would answer `false` here and get the composite decomposed into primitives.
    pub fn keeps_composite(self, op: &Op) -> bool {
        match self {
            Backend::Reference | Backend::Cpu | Backend::Wgpu | Backend::Cuda => kept_composite(op),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Backend::ALL.iter().map(|b| b.name()).collect();
                format!("unknown backend `{s}` (known: {})", known.join(", "))
            })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum RuntimeError {
    /// The backend is not built in or not present.
    Unavailable(String),
    /// The pass pipeline failed (a pass error, or a graph the verifier refused after a pass).
    Pipeline(String),
    /// The graph cannot be lowered for this backend.
    Lower(String),
    /// Bad input data (wrong type, out-of-range index, ...).
    Input(String),
    /// The backend failed while running.
    Backend(String),
    /// The Program needs more memory than the backend has; said before anything is allocated.
    DoesNotFit(String),
}

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuntimeError::Unavailable(m)
            | RuntimeError::Pipeline(m)
            | RuntimeError::Lower(m)
            | RuntimeError::Input(m)
            | RuntimeError::Backend(m)
            | RuntimeError::DoesNotFit(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for RuntimeError {}

/// Bytes as MiB for messages.
pub fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// Memory as a backend measures it (`Executor::measured_memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeasuredMemory {
    /// Bytes the device's allocator reported the arena (with the composites' tables and scratch)
    /// to take when it was allocated: its bytes in use after, less before. Staging buffers the
    /// runtime keeps for its own reads and writes are not counted.
    pub device_bytes: u64,
    /// Bytes of host memory holding values offloaded from the device.
    pub host_bytes: u64,
}

/// A step loaded on a backend.
pub trait Executor {
    /// The graph whose values `write` and `read` address: the legalized graph a compiled
    /// backend's Program runs, the optimized graph itself on the interpreter. Its inputs and
    /// outputs are those of the graph that was compiled, in the same order.
    fn graph(&self) -> &Graph;
    /// The Program it runs; `None` on the interpreter, which runs the graph itself.
    fn program(&self) -> Option<&Program> {
        None
    }
    /// How it reaches the other ranks of its run.
    fn communicator(&self) -> &dyn Communicator;
    /// Writes a graph input (or any planned value).
    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError>;
    /// Runs every step once.
    fn run(&mut self) -> Result<(), RuntimeError>;
    /// Reads a value (a graph output, or an input not yet overwritten).
    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError>;
    /// Bytes of memory held for tensors: the arena on a compiled backend, the peak of live
    /// tensors in the last run on the interpreter.
    fn memory_bytes(&self) -> usize;
    /// What the memory is measured to hold, where the backend can measure it: on a device, what
    /// its allocator gave the arena and the host memory holding offloaded values.
    fn measured_memory(&self) -> Option<MeasuredMemory> {
        None
    }
    /// Puts the donated inputs back as they were before the last `run`, where the backend kept
    /// them: `false` where it updates them in place (every compiled backend), and then the state
    /// after a failed step is not one any completed step left.
    fn undo_last_run(&mut self) -> bool {
        false
    }
    /// Time by step kind, when the backend was asked to profile (`RuntimeOptions::profile`).
    fn profile_report(&mut self) -> Option<String> {
        None
    }
    /// The device graphs this executor replays (`RuntimeOptions::device_graphs`): how many, and
    /// how many Program steps they hold; `None` on backends without device graphs.
    fn device_graphs(&self) -> Option<(usize, usize)> {
        None
    }
    /// Turns timeline recording on or off for the runs that follow; `false` where this
    /// executor cannot record one (the interpreter runs nodes, not Program steps).
    fn record_timeline(&mut self, _on: bool) -> bool {
        false
    }
    /// The timeline of the last run recorded, once (`None` when none was); rank 0's where the
    /// executor runs several ranks.
    fn take_timeline(&mut self) -> Option<Timeline> {
        None
    }
    /// Every rank's timeline of the last run recorded, in rank order, once: one for a run of one
    /// rank, none where none was recorded.
    fn take_rank_timelines(&mut self) -> Vec<Timeline> {
        self.take_timeline().into_iter().collect()
    }
    /// Per rank, the time the last run spent blocked in collective waits, for other ranks or
    /// for the collective to finish; empty for a run of one rank.
    fn blocked_in_waits(&self) -> Vec<std::time::Duration> {
        Vec::new()
    }
    /// Per rank, the part of `blocked_in_waits` spent before every member had started the
    /// collective: waiting for peers rather than for the transfer (the rest is exposed
    /// communication).
    fn blocked_for_peers(&self) -> Vec<std::time::Duration> {
        Vec::new()
    }
}

/// Compiles `g` without passes and loads it on `backend`, with default runtime options and one
/// rank.
pub fn load(g: &Graph, backend: Backend, mode: Mode) -> Result<Box<dyn Executor>, RuntimeError> {
    let pipeline = graphtrain_passes::Pipeline::new(Vec::new());
    let options = CompileOptions::new(&pipeline, mode);
    compile(g, backend, &options)?.load(Box::new(SingleRank))
}

/// Runs `g` once on `backend` from host inputs (in `g.inputs` order) and returns its outputs: the
/// one-shot form tests use.
pub fn run_once(
    g: &Graph,
    backend: Backend,
    mode: Mode,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, RuntimeError> {
    run_once_with(g, backend, mode, RuntimeOptions::default(), inputs)
}

/// `run_once` with the executor loaded under `runtime` (a kernel choice, say).
pub fn run_once_with(
    g: &Graph,
    backend: Backend,
    mode: Mode,
    runtime: RuntimeOptions,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, RuntimeError> {
    let pipeline = graphtrain_passes::Pipeline::new(Vec::new());
    let options = CompileOptions {
        runtime,
        ..CompileOptions::new(&pipeline, mode)
    };
    run_compiled(compile(g, backend, &options)?, inputs)
}

/// Loads `compiled` on one rank, runs it once from host inputs (in its graph's input order) and
/// returns its outputs.
pub fn run_compiled(
    compiled: Compiled,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, RuntimeError> {
    let mut ex = compiled.load(Box::new(SingleRank))?;
    let prog_inputs: Vec<ValueId> = ex.graph().inputs.iter().map(|i| i.value).collect();
    if prog_inputs.len() != inputs.len() {
        return Err(RuntimeError::Input(format!(
            "the graph takes {} inputs, got {}",
            prog_inputs.len(),
            inputs.len()
        )));
    }
    for (v, t) in prog_inputs.iter().zip(inputs) {
        ex.write(*v, t)?;
    }
    ex.run()?;
    let outs: Vec<ValueId> = ex.graph().outputs.iter().map(|o| o.value).collect();
    outs.into_iter().map(|v| ex.read(v)).collect()
}
