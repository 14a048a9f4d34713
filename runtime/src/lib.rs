//! graphtrain's runtime: runs a lowered `Program` (graphtrain-lowering) on a backend.
//!
//! - `Backend` names what `--backend` accepts and says, for one that is not built in or not
//!   present, what is missing and how to get it;
//! - `Executor` is what every backend implements: write inputs into the arena, run the steps,
//!   read values back. Parameters and optimizer state stay in the arena between steps (their
//!   outputs are donated to their inputs), so a training loop only writes the batch;
//! - `cpu` (cubecl-cpu) is the fast compiled backend; `device` runs the same Programs on
//!   `wgpu` and `cuda`, its composites on kernels of their own; `reference` runs the
//!   interpreter.
//!
//! Invariant: an executor never changes a Program's numerics: the same Program on the same
//! backend gives bitwise identical results every run (no autotuning, fixed summation orders).

pub mod adamw;
pub mod attention;
pub mod cpu;
pub mod cross_entropy;
pub mod device;
pub mod device_composites;
pub mod device_kernels;
pub mod gemm;
pub mod kernels;
pub mod launches;
pub mod pool;
pub mod replay;
pub mod rope;
mod rows;

use device::DeviceKind;
use graphtrain_ir::{interp, Graph, HostTensor, Op, ValueId};
use graphtrain_lowering::{kept_composite, lower_with, Mode, Program};
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
            | RuntimeError::Lower(m)
            | RuntimeError::Input(m)
            | RuntimeError::Backend(m)
            | RuntimeError::DoesNotFit(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for RuntimeError {}

/// Host memory a new allocation may use: `GRAPHTRAIN_MEMORY_LIMIT_MIB` when set (to share a
/// machine, or to try the does-not-fit path), else the OS's estimate of available memory
/// (Linux `MemAvailable`); `None` when neither is known.
pub fn available_memory_bytes() -> Option<usize> {
    if let Some(mib) = std::env::var("GRAPHTRAIN_MEMORY_LIMIT_MIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return Some(mib << 20);
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Whether `t` may be written into value `v` of `p` on a compiled backend: the same type, and
/// integers that its f32 storage holds exactly.
pub(crate) fn check_input(p: &Program, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
    let ty = p.graph.ty(v);
    if &t.ty != ty {
        return Err(RuntimeError::Input(format!(
            "value {v:?} expects {ty}, got {}",
            t.ty
        )));
    }
    if !ty.dtype.is_float() {
        let limit = graphtrain_lowering::program::MAX_EXACT_INT as f64;
        if let Some(bad) = t.data.iter().find(|x| x.abs() > limit) {
            return Err(RuntimeError::Input(format!(
                "integer {bad} is beyond 2^24, which the f32 storage of this backend cannot hold exactly"
            )));
        }
    }
    Ok(())
}

/// Element `i` of an iota step: its index along a dim of size `dim` with `inner` elements
/// below it. Computed on the host by every compiled backend.
pub(crate) fn iota_value(i: usize, inner: usize, dim: usize) -> f32 {
    ((i / inner.max(1)) % dim.max(1)) as f32
}

/// Element `i` of a random step's draw from `seed` (as the f32 the arena holds it).
pub(crate) fn random_value(seed: f32, stream: u64, normal: bool, i: usize) -> f32 {
    let seed = seed as i64 as u64;
    let x = if normal {
        graphtrain_ir::rng::normal(seed, stream, i as u64)
    } else {
        graphtrain_ir::rng::uniform(seed, stream, i as u64)
    };
    x as f32
}

/// Bytes as MiB for messages.
pub fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// A Program loaded on a backend.
pub trait Executor {
    fn program(&self) -> &Program;
    /// Writes a graph input (or any planned value).
    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError>;
    /// Runs every step once.
    fn run(&mut self) -> Result<(), RuntimeError>;
    /// Reads a value (a graph output, or an input not yet overwritten).
    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError>;
    /// Bytes of device memory held for tensors (the arena).
    fn memory_bytes(&self) -> usize;
    /// Time by step kind, when the backend was asked to profile (`GRAPHTRAIN_PROFILE=1`).
    fn profile_report(&mut self) -> Option<String> {
        None
    }
}

/// The interpreter behind the same interface: inputs kept on the host, outputs written back into
/// the donated inputs after each run.
pub struct ReferenceExecutor {
    program: Program,
    values: Vec<Option<HostTensor>>,
    peak: usize,
}

impl ReferenceExecutor {
    pub fn new(program: Program) -> Self {
        let n = program.graph.values.len();
        ReferenceExecutor {
            program,
            values: vec![None; n],
            peak: 0,
        }
    }
}

impl Executor for ReferenceExecutor {
    fn program(&self) -> &Program {
        &self.program
    }

    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
        self.values[v.index()] = Some(t.clone());
        Ok(())
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let g = &self.program.graph;
        let inputs: Vec<HostTensor> = g
            .inputs
            .iter()
            .map(|i| {
                self.values[i.value.index()].clone().ok_or_else(|| {
                    RuntimeError::Input(format!("input `{}` was never written", i.name))
                })
            })
            .collect::<Result<_, _>>()?;
        let out = interp::run(g, &inputs).map_err(|e| RuntimeError::Backend(e.to_string()))?;
        self.peak = out.peak_bytes;
        for (o, t) in g.outputs.iter().zip(out.outputs) {
            if let Some(d) = o.donates {
                self.values[d.index()] = Some(t.clone());
            }
            self.values[o.value.index()] = Some(t);
        }
        Ok(())
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError> {
        self.values[v.index()]
            .clone()
            .ok_or_else(|| RuntimeError::Input(format!("value {v:?} has no data yet")))
    }

    fn memory_bytes(&self) -> usize {
        self.peak
    }
}

/// Lowers `g` and loads it on `backend`.
pub fn load(g: &Graph, backend: Backend, mode: Mode) -> Result<Box<dyn Executor>, RuntimeError> {
    if let Some(why) = backend.unavailable() {
        return Err(RuntimeError::Unavailable(why));
    }
    let program = lower_with(g, mode, &|op| backend.keeps_composite(op))
        .map_err(|e| RuntimeError::Lower(e.to_string()))?;
    Ok(match backend {
        Backend::Reference => Box::new(ReferenceExecutor::new(program)),
        Backend::Cpu => Box::new(cpu::CpuExecutor::new(program)?),
        Backend::Wgpu => Box::new(device::DeviceExecutor::new(program, DeviceKind::Wgpu)?),
        Backend::Cuda => Box::new(device::DeviceExecutor::new(program, DeviceKind::Cuda)?),
    })
}

/// Runs `g` once on `backend` from host inputs (in `g.inputs` order) and returns its outputs: the
/// one-shot form tests use.
pub fn run_once(
    g: &Graph,
    backend: Backend,
    mode: Mode,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, RuntimeError> {
    let mut ex = load(g, backend, mode)?;
    let prog_inputs: Vec<ValueId> = ex.program().graph.inputs.iter().map(|i| i.value).collect();
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
    let outs: Vec<ValueId> = ex.program().graph.outputs.iter().map(|o| o.value).collect();
    outs.into_iter().map(|v| ex.read(v)).collect()
}
