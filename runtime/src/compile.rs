//! The one driver: a train-step graph in, a runnable step out. Every caller that runs a step
//! (the trainer, `bench`, the numerics gate; next the ranks, the simulator and the search loop)
//! gets it here, in stages it can stop between:
//!
//! 1. `compile`: the pass pipeline (verified after each pass), then for a compiled backend
//!    legalization (`legalize`) and lowering to a `Program`. The result, `Compiled`, holds the
//!    optimized graph, its `Fingerprint` (equal graphs, equal fingerprints: a search measures
//!    each distinct graph once) and the Program (what a simulator reads), with what each stage
//!    took;
//!    On `cpu`, whose arena is host memory, `offload` has nothing to move: its nodes are removed
//!    before lowering and its record says so;
//! 2. `Compiled::load`: the executor for the backend, given its runtime options and its
//!    communicator.
//!
//! Guarantees: the pipeline's tier is the whole driver's: legalization adds only tier-1 changes
//! (decomposition as each composite defines it, `cse` and `dce`), so on one backend a tier-1
//! pipeline compiled fused runs bitwise equal to the unoptimized graph compiled eager.
//! Declines, with an error that names the stage: a backend that is not built in or not present
//! (before any work), a failing pass, a graph the lowering cannot hold (an unsupported dtype, an
//! integer beyond what f32 storage holds), a Program larger than the memory available.

use crate::cpu::CpuExecutor;
use crate::device::{DeviceExecutor, DeviceKind};
use crate::{Backend, Communicator, Executor, ReferenceExecutor, RuntimeError, RuntimeOptions};
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::{decompose::decompose, text, Graph, Placements};
use graphtrain_lowering::{lower_with_limits, FusionLimits, Mode, Program};
use graphtrain_passes::{PassRecord, Pipeline, PipelineSpec, Registry};
use std::fmt;
use std::time::{Duration, Instant};

/// How to compile: the passes to run, the lowering, and what the executor will be given.
pub struct CompileOptions<'p> {
    pub pipeline: &'p Pipeline,
    /// `Fused` (the default lowering: views read in place, elementwise chains in one kernel) or
    /// `Eager` (one step per node: the numerics baseline fused is bitwise equal to).
    pub mode: Mode,
    /// What one fused kernel may hold (fused mode only): the lowering is the one place that
    /// decides fusion, and these are its knobs.
    pub fusion: FusionLimits,
    pub runtime: RuntimeOptions,
    /// The element types the step computes in. The trainer applies it to the forward graph
    /// before autodiff (`graphtrain_ir::autocast`); `compile` takes the graph as it comes.
    pub precision: Precision,
}

impl<'p> CompileOptions<'p> {
    /// `pipeline` lowered in `mode`, with default runtime options.
    pub fn new(pipeline: &'p Pipeline, mode: Mode) -> Self {
        CompileOptions {
            pipeline,
            mode,
            fusion: FusionLimits::default(),
            runtime: RuntimeOptions::default(),
            precision: Precision::F32,
        }
    }
}

/// Wall time of each stage of `compile`.
#[derive(Clone, Debug, Default)]
pub struct CompileTimings {
    pub passes: Duration,
    /// Legalization and lowering (zero on the interpreter, which runs the graph itself).
    pub lower: Duration,
}

/// A 64-bit FNV-1a hash of a graph's text form: node order, ops, attributes, types and tags
/// all count, value numbering does not (the text form numbers values canonically).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub u64);

impl Fingerprint {
    pub fn of(g: &Graph) -> Fingerprint {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in text::print(g).bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Fingerprint(h)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A step compiled for one backend, not yet loaded.
pub struct Compiled {
    pub backend: Backend,
    /// The graph after the pipeline: its inputs and outputs are the step's, in order.
    pub graph: Graph,
    pub fingerprint: Fingerprint,
    /// What each pass did.
    pub passes: Vec<PassRecord>,
    /// The lowered step; `None` on the interpreter.
    pub program: Option<Program>,
    pub timings: CompileTimings,
    pub runtime: RuntimeOptions,
}

/// Runs `options.pipeline` on `graph`, then legalizes and lowers the result for `backend`.
pub fn compile(
    graph: &Graph,
    backend: Backend,
    options: &CompileOptions<'_>,
) -> Result<Compiled, RuntimeError> {
    if let Some(why) = backend.unavailable() {
        return Err(RuntimeError::Unavailable(why));
    }
    let t0 = Instant::now();
    let (mut optimized, mut passes) =
        tracing::info_span!("passes", count = options.pipeline.passes.len())
            .in_scope(|| options.pipeline.run(graph))
            .map_err(|e| RuntimeError::Pipeline(e.to_string()))?;
    if backend == Backend::Cpu {
        if let Some((kept, values)) = graphtrain_passes::offload::without_offloading(&optimized) {
            optimized = kept;
            for record in passes.iter_mut().filter(|r| r.pass == "offload") {
                record.report.decline(
                    None,
                    "",
                    format!(
                        "the cpu backend's arena is host memory: nothing to move, so the {values} \
offloaded values stay in the arena (offload and reload removed before lowering)"
                    ),
                );
            }
        }
    }
    let t1 = Instant::now();
    let program = match backend {
        Backend::Reference => None,
        Backend::Cpu | Backend::Wgpu | Backend::Cuda => Some(lower_for_backend(
            &optimized,
            backend,
            options.mode,
            &options.fusion,
        )?),
    };
    let t2 = Instant::now();
    Ok(Compiled {
        backend,
        fingerprint: Fingerprint::of(&optimized),
        graph: optimized,
        passes,
        program,
        timings: CompileTimings {
            passes: t1 - t0,
            lower: t2 - t1,
        },
        runtime: options.runtime.clone(),
    })
}

/// The Program `optimized` (a graph after its pipeline) lowers to for compiled `backend`:
/// legalized (`legalize`), then lowered in `mode` under `fusion`. Needs no device: the
/// simulator lowers through it for machines it does not have.
pub fn lower_for_backend(
    optimized: &Graph,
    backend: Backend,
    mode: Mode,
    fusion: &FusionLimits,
) -> Result<Program, RuntimeError> {
    let legal = tracing::info_span!("legalize", ?backend)
        .in_scope(|| legalize(optimized, backend, mode))?;
    let keep = |op: &graphtrain_ir::Op| backend.keeps_composite(op);
    let mut program = tracing::info_span!("lower", ?mode)
        .in_scope(|| lower_with_limits(&legal, mode, &keep, fusion))
        .map_err(|e| RuntimeError::Lower(e.to_string()))?;
    if backend == Backend::Cpu {
        // The cpu backend's GEMM and map kernels take bf16 stored in 2 bytes where the
        // lowering allows it; the device backends read and write f32 slots only.
        let chosen = program.store_bf16_in_two_bytes();
        tracing::info!(values = chosen, "bf16 values stored in 2 bytes");
    }
    Ok(program)
}

/// The graph a compiled backend's lowering takes: every composite `backend` has no kernel for
/// decomposed into primitives, then, in fused mode, `cse` and `dce` over the result: the
/// optimizer's per-parameter scalar chains (bias corrections, lr products) are identical across
/// parameters and collapse to one each, which saves hundreds of tiny launches per step. Eager
/// mode keeps one step per node of the decomposed graph, as the numerics baseline. Tier 1.
pub fn legalize(g: &Graph, backend: Backend, mode: Mode) -> Result<Graph, RuntimeError> {
    let mut primitives = decompose(g, &|op| op.is_composite() && !backend.keeps_composite(op))
        .map_err(|e| RuntimeError::Lower(format!("decomposing composites failed: {e}")))?;
    if mode == Mode::Eager {
        return Ok(primitives);
    }
    // Placements were checked on `g`. Inside a decomposed composite they need not be
    // expressible: an embedding flattens its ids, and ids split by sequence (sequence
    // parallelism) do not stay one contiguous block per rank when flattened, though each rank's
    // rows are still its own. So the cleanup runs on the graph without its signature's
    // placements (nothing is placement-checked), and they are put back after.
    let placements: Vec<(String, Option<Placements>)> = primitives
        .inputs
        .iter_mut()
        .map(|i| (i.name.clone(), i.placement.take()))
        .collect();
    let cleanup = PipelineSpec::parse_list("cse,dce")
        .and_then(|spec| spec.build(&Registry::builtin()))
        .map_err(RuntimeError::Pipeline)?;
    let (mut out, _) = cleanup
        .run(&primitives)
        .map_err(|e| RuntimeError::Pipeline(e.to_string()))?;
    for (name, p) in placements {
        if let Some(input) = out.inputs.iter_mut().find(|i| i.name == name) {
            input.placement = p;
        }
    }
    Ok(out)
}

impl Compiled {
    /// Loads the step on its backend: the arena allocated and the constants written (kernels
    /// compile on the first run).
    ///
    /// Declines a communicator whose world is not the graph's mesh (a graph without a mesh is
    /// one rank's), and collectives on a backend that cannot run them yet.
    pub fn load(self, comm: Box<dyn Communicator>) -> Result<Box<dyn Executor>, RuntimeError> {
        let ranks = self.graph.mesh.as_ref().map_or(1, |m| m.world_size());
        if ranks != comm.world_size() {
            let graph = match &self.graph.mesh {
                Some(mesh) => format!("the graph's mesh {mesh} has {ranks} ranks"),
                None => "the graph has no mesh (one rank)".to_string(),
            };
            return Err(RuntimeError::Input(format!(
                "{graph}, and the run has {}: each rank runs the graph of its mesh",
                comm.world_size()
            )));
        }
        let runtime = self.runtime;
        let _span = tracing::info_span!("load", backend = ?self.backend).entered();
        Ok(match (self.backend, self.program) {
            (Backend::Reference, _) => Box::new(ReferenceExecutor::new(self.graph, comm)),
            (Backend::Cpu, Some(program)) => Box::new(CpuExecutor::new(program, runtime, comm)?),
            (Backend::Wgpu, Some(program)) => Box::new(DeviceExecutor::new(
                program,
                DeviceKind::Wgpu,
                runtime,
                comm,
            )?),
            (Backend::Cuda, Some(program)) => Box::new(DeviceExecutor::new(
                program,
                DeviceKind::Cuda,
                runtime,
                comm,
            )?),
            (backend, None) => {
                return Err(RuntimeError::Lower(format!(
                    "the {backend} backend needs a Program, and none was lowered"
                )))
            }
        })
    }
}
