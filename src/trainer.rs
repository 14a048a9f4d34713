//! The training loop: builds the train-step graph once, compiles it for a backend through the
//! one driver (`graphtrain_runtime::compile`), initializes parameters and optimizer state, then
//! per step feeds a batch, the learning rate and the step count and runs the step. Parameters
//! and optimizer state stay in the executor between steps (donated outputs replace their
//! inputs there); the trainer reads them back only for checkpoints and inspection.
//!
//! On a mesh (`Trainer::build_on` with a `MeshRun`) the step is the SPMD step of
//! `parallelize`. With `Launch::Threads` every rank is a thread (`Compiled::load_ranks`) and the
//! trainer still holds global tensors: it initializes parameters as on one device, the ranks'
//! executor gives each rank its part and assembles what is read back, so checkpoints and
//! samples are the same as one device's. With `Launch::Mpi` this process is one rank: it
//! initializes whole tensors the same way and keeps its part, and gathers every rank's part
//! for a checkpoint (so every rank must ask for it). With `Launch::FakeRankZero` rank 0 runs
//! alone on its own freshly initialized parts, for time and memory only.

use crate::checkpoint::{Checkpoint, Header, RunIdentity, TensorEntry};
use crate::data::{Batch, DataSource};
use crate::lr_schedule::LrSchedule;
use graphtrain_ir::autocast::{autocast, Precision};
use graphtrain_ir::optim::{build_train_step, OptimConfig, TrainStep};
use graphtrain_ir::{
    mesh::local_part, rng, verify, DType, Graph, HostTensor, Init, InputKind, Mesh, TensorType,
    ValueId,
};
use graphtrain_lowering::{FusionLimits, Mode, Program};
use graphtrain_models::Llama3Config;
use graphtrain_passes::parallelize::{parallelize, Plan};
use graphtrain_passes::{PassRecord, Pipeline};
use graphtrain_runtime::{
    compile, global_type, Backend, CompileOptions, Compiled, Executor, FakeRank, Fingerprint,
    RuntimeOptions, SingleRank, Timeline,
};
use std::fmt;
use std::time::{Duration, Instant};

/// Stream ids `PARAM_STREAM_BASE + i` initialize parameter `i`, apart from the data stream.
const PARAM_STREAM_BASE: u64 = 1;

#[derive(Clone, Debug, PartialEq)]
pub struct TrainError(pub String);

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TrainError {}

fn err(e: impl fmt::Display) -> TrainError {
    TrainError(e.to_string())
}

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub data: DataSource,
    pub seed: u64,
    /// The lr of each step, written into the step's `lr` input before it runs.
    pub lr: LrSchedule,
    pub optim: OptimConfig,
}

/// Wall time of each stage that runs before the first step.
#[derive(Clone, Debug, Default)]
pub struct BuildTimings {
    pub trace: Duration,
    pub autodiff_and_optimizer: Duration,
    pub verify: Duration,
    pub passes: Duration,
    /// Legalization and lowering to a Program (zero on the interpreter).
    pub lower: Duration,
    /// Loading the Program on its backend: arena, constants, parameters and state written.
    pub load: Duration,
}

/// A traced train step (forward, loss, backward, optimizer), verified, before any pass.
pub struct Traced {
    pub step: TrainStep,
    pub timings: BuildTimings,
}

/// Traces `model` in `dtype`, appends backward and optimizer, and verifies the result.
pub fn build_step(
    model: &Llama3Config,
    dtype: DType,
    optim: &OptimConfig,
) -> Result<Traced, TrainError> {
    build_from_forward(model, dtype, Precision::F32, None, optim, |forward| {
        build_train_step(forward, "loss", optim).map_err(|e| e.to_string())
    })
}

/// `build_step` in f32 under `precision` (its matmuls in bf16 for `Bf16Mixed`).
pub fn build_step_in(
    model: &Llama3Config,
    precision: Precision,
    optim: &OptimConfig,
) -> Result<Traced, TrainError> {
    build_from_forward(model, DType::F32, precision, None, optim, |forward| {
        build_train_step(forward, "loss", optim).map_err(|e| e.to_string())
    })
}

/// A forward pass and loss from elsewhere than graphtrain's Llama (a frontend's import, such as
/// the burn frontend's), with its parameters' starting values. The trainer builds the train
/// step from it as from a traced model; the `Llama3Config` it is given beside describes the
/// batches (batch, sequence, vocabulary) and the FLOPs that MFU counts.
#[derive(Clone, Debug)]
pub struct ImportedModel {
    /// Output `loss`, a scalar; inputs `tokens` and `targets`, i32 `[batch, seq]`.
    pub forward: graphtrain_ir::Traced,
    /// Every parameter's starting value, by name.
    pub initial: Vec<(String, HostTensor)>,
}

/// Traces `model`'s forward pass and loss in `dtype` (or takes `imported`'s), makes the train
/// step of it with `to_step` (backward and optimizer, for one device or every rank), and
/// verifies the result. Where `optim` splits the batch into micro-batches, the forward is
/// traced at one micro-batch's rows.
fn build_from_forward(
    model: &Llama3Config,
    dtype: DType,
    precision: Precision,
    imported: Option<&ImportedModel>,
    optim: &OptimConfig,
    to_step: impl FnOnce(graphtrain_ir::Traced) -> Result<TrainStep, String>,
) -> Result<Traced, TrainError> {
    model
        .validate()
        .map_err(|e| err(format!("invalid config: {e}")))?;
    let micro = micro_batch_model(model, optim.micro_batches, imported.is_some())?;
    let t0 = Instant::now();
    let mut forward = match imported {
        Some(m) if dtype == DType::F32 => m.forward.clone(),
        Some(_) => return Err(err("an imported model trains in f32 (or bf16-mixed)")),
        None => tracing::info_span!("trace")
            .in_scope(|| micro.trace(dtype))
            .map_err(|e| err(format!("tracing failed: {e}")))?,
    };
    forward.graph = autocast(&forward.graph, precision)
        .map_err(|e| err(format!("--precision {}: {e}", precision.name())))?;
    let t1 = Instant::now();
    let step = tracing::info_span!("autodiff")
        .in_scope(|| to_step(forward))
        .map_err(err)?;
    let t2 = Instant::now();
    tracing::info_span!("verify")
        .in_scope(|| verify(&step.graph))
        .map_err(|e| err(format!("the train-step graph fails verification: {e}")))?;
    let t3 = Instant::now();
    Ok(Traced {
        step,
        timings: BuildTimings {
            trace: t1 - t0,
            autodiff_and_optimizer: t2 - t1,
            verify: t3 - t2,
            ..BuildTimings::default()
        },
    })
}

/// `model` at one micro-batch's rows, when the batch is split into `micro_batches`.
fn micro_batch_model(
    model: &Llama3Config,
    micro_batches: u32,
    imported: bool,
) -> Result<Llama3Config, TrainError> {
    let n = micro_batches as usize;
    if n <= 1 {
        return Ok(model.clone());
    }
    if imported {
        return Err(err(format!(
            "--micro-batches {n}: an imported model's forward comes traced at the whole batch; splitting it is not built"
        )));
    }
    if !model.batch.is_multiple_of(n) {
        return Err(err(format!(
            "--micro-batches {n}: the batch of {} rows does not split into {n} equal micro-batches",
            model.batch
        )));
    }
    Ok(Llama3Config {
        batch: model.batch / n,
        ..model.clone()
    })
}

/// How a mesh run is laid out: the mesh, the plan that places parameters on it, how its ranks
/// run, and each rank's share of the cores.
#[derive(Clone, Debug)]
pub struct MeshRun {
    pub mesh: Mesh,
    pub plan: Plan,
    pub threads_per_rank: usize,
    pub launch: Launch,
    /// An emulated network link per mesh dimension (threads only; none: shared memory).
    pub links: Vec<Option<graphtrain_runtime::Link>>,
}

/// How the ranks of a mesh run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// Every rank a thread of this process, collectives in shared memory (`--launcher threads`).
    Threads,
    /// Rank 0 alone with `FakeRank` collectives (no data moves, values no real run's): one
    /// rank's compute time and memory on a mesh larger than the machine (`--launcher fake`).
    /// The trainer then holds rank 0's own tensors, not global ones, and refuses to checkpoint.
    FakeRankZero,
    /// This process is one rank of an MPI job (`mpirun ... --launcher mpi`): it holds its own
    /// parts, initialized as the threads engine's (whole tensors, then its part), so that a run
    /// is bitwise the threads engine's; whole tensors (parameters, checkpoints) are gathered
    /// from every rank, which makes those calls collective: every rank must make them.
    Mpi,
}

/// Where the train step runs: one device, every rank of its mesh as threads, one rank alone, or
/// this process's rank of an MPI job.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ranks {
    One,
    Threads(usize, Links),
    FakeRankZero,
    Mpi { rank: usize },
}

impl Ranks {
    /// The rank whose parts the trainer holds, when it holds one rank's parts.
    fn held_rank(self) -> Option<usize> {
        match self {
            Ranks::FakeRankZero => Some(0),
            Ranks::Mpi { rank } => Some(rank),
            Ranks::One | Ranks::Threads(..) => None,
        }
    }
}

/// Emulated links per mesh dimension, kept `Copy` (meshes have at most `MAX_DIMS` dimensions).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Links([Option<graphtrain_runtime::Link>; Links::MAX_DIMS]);

impl Links {
    const MAX_DIMS: usize = graphtrain_ir::mesh::MESH_DIM_NAMES.len();

    fn of(links: &[Option<graphtrain_runtime::Link>]) -> Links {
        let mut out = [None; Self::MAX_DIMS];
        for (o, l) in out.iter_mut().zip(links) {
            *o = *l;
        }
        Links(out)
    }

    fn to_vec(self) -> Vec<Option<graphtrain_runtime::Link>> {
        self.0.to_vec()
    }
}

/// This process's rank of its MPI job, starting MPI on first use.
#[cfg(feature = "mpi")]
pub fn mpi_rank() -> Result<usize, TrainError> {
    graphtrain_runtime::mpi_comm::world()
        .map(|w| w.rank())
        .map_err(err)
}

#[cfg(not(feature = "mpi"))]
pub fn mpi_rank() -> Result<usize, TrainError> {
    Err(err(
        "--launcher mpi: this graphtrain was built without MPI (the `mpi` feature)",
    ))
}

/// Every rank's `bytes`, in rank order (a collective over the MPI job).
#[cfg(feature = "mpi")]
fn mpi_all_gather(bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
    graphtrain_runtime::mpi_comm::world()
        .and_then(|w| w.all_gather_bytes(bytes))
        .map_err(err)
}

#[cfg(not(feature = "mpi"))]
fn mpi_all_gather(_: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
    mpi_rank().map(|_| Vec::new())
}

/// The communicator of this process's rank of its MPI job.
#[cfg(feature = "mpi")]
fn mpi_communicator(
    options: &graphtrain_runtime::RuntimeOptions,
) -> Result<Box<dyn graphtrain_runtime::Communicator>, TrainError> {
    let world = graphtrain_runtime::mpi_comm::world().map_err(err)?;
    Ok(Box::new(world.communicator(options)))
}

#[cfg(not(feature = "mpi"))]
fn mpi_communicator(
    _: &graphtrain_runtime::RuntimeOptions,
) -> Result<Box<dyn graphtrain_runtime::Communicator>, TrainError> {
    mpi_rank().map(|_| unreachable!("mpi_rank fails without the feature"))
}

/// `t`'s values as little-endian f64 bytes, and back.
fn to_bytes(t: &HostTensor) -> Vec<u8> {
    t.data.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_bytes(ty: TensorType, bytes: &[u8]) -> Result<HostTensor, TrainError> {
    let data = bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    HostTensor::new(ty, data).map_err(err)
}

/// The SPMD train step of `model` over `mesh`, parameters placed by `plan`: the single-device
/// forward traced once, then `parallelize` (autodiff, collectives, sharded AdamW), verified.
pub fn build_spmd_step(
    model: &Llama3Config,
    mesh: &Mesh,
    plan: &Plan,
    optim: &OptimConfig,
) -> Result<Traced, TrainError> {
    build_spmd_step_in(model, mesh, plan, optim, Precision::F32)
}

/// The train step of `model` under `precision`: one rank's SPMD step on `mesh` with `plan`
/// where one is given, else one device's.
pub fn build_step_on(
    model: &Llama3Config,
    mesh: Option<(&Mesh, &Plan)>,
    optim: &OptimConfig,
    precision: Precision,
) -> Result<Traced, TrainError> {
    match mesh {
        Some((mesh, plan)) => build_spmd_step_in(model, mesh, plan, optim, precision),
        None => build_step_in(model, precision, optim),
    }
}

/// `build_spmd_step` under `precision`.
pub fn build_spmd_step_in(
    model: &Llama3Config,
    mesh: &Mesh,
    plan: &Plan,
    optim: &OptimConfig,
    precision: Precision,
) -> Result<Traced, TrainError> {
    build_spmd_step_from(model, None, mesh, plan, optim, precision)
}

/// `build_spmd_step_in` from `imported`'s forward where one is given.
fn build_spmd_step_from(
    model: &Llama3Config,
    imported: Option<&ImportedModel>,
    mesh: &Mesh,
    plan: &Plan,
    optim: &OptimConfig,
    precision: Precision,
) -> Result<Traced, TrainError> {
    check_heads_split(model, mesh)?;
    build_from_forward(model, DType::F32, precision, imported, optim, |forward| {
        let micro = match optim.micro_batches {
            n if n > 1 => format!(
                " (a micro-batch of {} rows of --micro-batches {n})",
                model.batch / n as usize
            ),
            _ => String::new(),
        };
        parallelize(forward, mesh, plan, optim)
            .map(|p| p.step)
            .map_err(|e| format!("--mesh {mesh}{micro}: {e}"))
    })
}

/// Tensor parallelism gives each `tp` rank whole attention heads: the query heads and the key
/// and value heads must each split evenly. Key and value heads fewer than (or not a multiple
/// of) `tp` are refused: replicating them over `tp` is not built.
fn check_heads_split(model: &Llama3Config, mesh: &Mesh) -> Result<(), TrainError> {
    let tp = mesh.size_of("tp");
    for (what, heads) in [
        ("query heads", model.n_heads),
        ("key/value heads", model.n_kv_heads),
    ] {
        if !heads.is_multiple_of(tp) {
            return Err(err(format!(
                "--mesh {mesh}: {heads} {what} do not split over tp={tp}; tensor parallelism gives each rank whole heads (replicating key/value heads over tp is not built)"
            )));
        }
    }
    Ok(())
}

/// Stops every rank of an MPI job before its first step unless all built the same thing: the
/// compiled graph's fingerprint, the model, the training config, the mesh and the plan.
fn agree_across_ranks(
    fingerprint: &str,
    model: &Llama3Config,
    cfg: &TrainConfig,
    run: &MeshRun,
) -> Result<(), TrainError> {
    let mine = format!(
        "graph {fingerprint}; model {model:?}; seed {} lr {} optim {:?} data {}; mesh {}; plan {}",
        cfg.seed,
        cfg.lr,
        cfg.optim,
        cfg.data.identity(),
        run.mesh,
        run.plan.to_ron()
    );
    let all = mpi_all_gather(mine.into_bytes())?;
    let differ: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|(_, theirs)| theirs.as_slice() != all[0].as_slice())
        .map(|(r, _)| r)
        .collect();
    let Some(&first) = differ.first() else {
        return Ok(());
    };
    Err(err(format!(
        "--launcher mpi: rank(s) {differ:?} built another train step than rank 0 (rank 0: {}; rank {first}: {}); stopping before step 1",
        String::from_utf8_lossy(&all[0]),
        String::from_utf8_lossy(&all[first]),
    )))
}

/// Writes every graph input from `slots`. The executor's graph has the trainer's inputs in the
/// same order, but its own value ids (a compiled backend runs the legalized graph).
fn write_inputs(exec: &mut dyn Executor, slots: &[HostTensor]) -> Result<(), TrainError> {
    for (v, slot) in program_inputs(exec).into_iter().zip(slots) {
        exec.write(v, slot).map_err(err)?;
    }
    Ok(())
}

/// The executor's input values, in the trainer's input order.
fn program_inputs(exec: &dyn Executor) -> Vec<ValueId> {
    exec.graph().inputs.iter().map(|i| i.value).collect()
}

/// Loads `compiled` on one rank, on every rank of its mesh as threads with `threads` each, or
/// as rank 0 alone, and writes every input from `slots` (for threads, global tensors: each
/// rank gets its part).
fn load(
    compiled: Compiled,
    ranks: Ranks,
    slots: &[HostTensor],
) -> Result<Box<dyn Executor>, TrainError> {
    let world = compiled.graph.mesh.as_ref().map_or(1, |m| m.world_size());
    let mut exec = match ranks {
        Ranks::Threads(threads, links) => compiled.load_ranks_over(threads, links.to_vec()),
        Ranks::One => compiled.load(Box::new(SingleRank)),
        Ranks::FakeRankZero => compiled.load(Box::new(FakeRank { rank: 0, world })),
        Ranks::Mpi { .. } => {
            let comm = mpi_communicator(&compiled.runtime)?;
            compiled.load(comm)
        }
    }
    .map_err(err)?;
    write_inputs(exec.as_mut(), slots)?;
    Ok(exec)
}

/// The global type of input `input` of `graph`: its own type, or on a mesh the type its
/// placement makes of the rank-local one.
fn global_input_type(graph: &Graph, input: &graphtrain_ir::Input) -> TensorType {
    let local = graph.ty(input.value);
    match &graph.mesh {
        Some(mesh) => global_type(mesh, local, input.placement.as_ref()),
        None => local.clone(),
    }
}

/// Initial value of a parameter: N(0, std) from its own stream, or a constant.
pub fn init_param(ty: &TensorType, init: Init, seed: u64, index: usize) -> HostTensor {
    let stream = PARAM_STREAM_BASE + index as u64;
    match init {
        Init::Normal { std } => {
            HostTensor::from_fn(ty.clone(), |i| std * rng::normal(seed, stream, i as u64))
        }
        Init::Ones => HostTensor::full(ty.clone(), 1.0),
        Init::Zeros => HostTensor::zeros(ty.clone()),
    }
}

/// A rank's block of a batch input as (rows, positions) of the whole batch `[batch, seq]`. A
/// batch split into micro-batches is fed as `[rows, micro-batches, seq]` in the same order
/// (`graphtrain_ir::micro_batches`): a block holding every micro-batch of its rows is the rows'
/// whole-batch block.
fn batch_block(
    block: Vec<std::ops::Range<usize>>,
    global: &[usize],
) -> Result<Vec<std::ops::Range<usize>>, TrainError> {
    match block.as_slice() {
        [rows, micro, positions] if *micro == (0..global[1]) => {
            let n = global[1];
            Ok(vec![rows.start * n..rows.end * n, positions.clone()])
        }
        [_, _, _] => Err(err(
            "a rank holds part of the micro-batches of its rows: a batch split over micro-batches is not built",
        )),
        _ => Ok(block),
    }
}

/// What the trainer feeds into each graph input.
enum Feed {
    Tokens,
    Targets,
    Lr,
    Step,
    /// Parameters and optimizer state: carried from step to step through donation.
    Carried,
}

#[derive(Clone, Debug)]
pub struct StepMetrics {
    /// 1-based: step N reports the loss of the N-th forward pass, after N-1 updates.
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    /// The learning rate this step's update used.
    pub lr: f64,
    /// Peak bytes of live tensors at graph dtypes, as the executor accounted them.
    pub peak_bytes: usize,
    pub seconds: f64,
    pub tokens: usize,
    /// Per rank, seconds the step spent blocked in collective waits, for other ranks or for
    /// the collective to finish (empty on one rank).
    pub wait_seconds: Vec<f64>,
    /// Per rank, the part of `wait_seconds` spent before every member had started the
    /// collective (waiting for peers); the rest is exposed communication.
    pub peer_wait_seconds: Vec<f64>,
}

pub struct Trainer {
    pub model: Llama3Config,
    /// The train step after the pass pipeline.
    pub graph: Graph,
    pub fingerprint: Fingerprint,
    pub timings: BuildTimings,
    /// What each pass of the pipeline did.
    pub passes: Vec<PassRecord>,
    /// Resident memory just before the step was loaded onto its backend.
    pub rss_before_load: Option<usize>,
    cfg: TrainConfig,
    /// What `use_backend` compiles with again.
    fusion: FusionLimits,
    /// The element types the step computes in (`autocast`).
    pub precision: Precision,
    /// Where the step runs.
    ranks: Ranks,
    runtime: RuntimeOptions,
    feeds: Vec<Feed>,
    /// Current value of every input; data slots are refilled each step, carried ones are stale
    /// while `slots_stale` (the executor holds the current values).
    slots: Vec<HostTensor>,
    loss_output: usize,
    grad_norm_output: usize,
    steps_done: u64,
    exec: Box<dyn Executor>,
    slots_stale: bool,
    /// A step failed after the executor had updated parameters in place: the state is not one
    /// any completed step left, so it must not be checkpointed.
    poisoned: bool,
    /// The batch the last completed step trained on, kept so it can be exported for replay.
    last_batch: Option<Batch>,
}

impl Trainer {
    /// Builds the step for `model` through `pipeline` and runs it on the reference interpreter,
    /// with parameters and state initialized.
    pub fn new(
        model: &Llama3Config,
        cfg: TrainConfig,
        pipeline: &Pipeline,
    ) -> Result<Self, TrainError> {
        Self::build(
            model,
            cfg,
            Backend::Reference,
            &CompileOptions::new(pipeline, Mode::Fused),
        )
    }

    /// Builds the step for `model`, compiles it for `backend` with `options` and initializes
    /// parameters and state.
    pub fn build(
        model: &Llama3Config,
        cfg: TrainConfig,
        backend: Backend,
        options: &CompileOptions<'_>,
    ) -> Result<Self, TrainError> {
        Self::build_on(model, cfg, backend, options, None)
    }

    /// As `build`, and with `mesh` the SPMD step on every rank of it, each rank a thread. The
    /// trainer still sees global tensors: parameters are initialized as on one device, each
    /// rank gets its part, and checkpoints hold the whole tensors.
    pub fn build_on(
        model: &Llama3Config,
        cfg: TrainConfig,
        backend: Backend,
        options: &CompileOptions<'_>,
        mesh: Option<&MeshRun>,
    ) -> Result<Self, TrainError> {
        Self::build_from(model, None, cfg, backend, options, mesh)
    }

    /// `build_on` for a model imported from another framework (`imported`), whose batches and
    /// FLOPs `model` describes.
    pub fn build_imported(
        model: &Llama3Config,
        imported: &ImportedModel,
        cfg: TrainConfig,
        backend: Backend,
        options: &CompileOptions<'_>,
        mesh: Option<&MeshRun>,
    ) -> Result<Self, TrainError> {
        Self::build_from(model, Some(imported), cfg, backend, options, mesh)
    }

    fn build_from(
        model: &Llama3Config,
        imported: Option<&ImportedModel>,
        cfg: TrainConfig,
        backend: Backend,
        options: &CompileOptions<'_>,
        mesh: Option<&MeshRun>,
    ) -> Result<Self, TrainError> {
        if let DataSource::Text(text) = &cfg.data {
            check_text_fits(text, model)?;
        }
        let Traced { step, mut timings } = match mesh {
            Some(run) => build_spmd_step_from(
                model,
                imported,
                &run.mesh,
                &run.plan,
                &cfg.optim,
                options.precision,
            )?,
            None => build_from_forward(
                model,
                DType::F32,
                options.precision,
                imported,
                &cfg.optim,
                |f| build_train_step(f, "loss", &cfg.optim).map_err(|e| e.to_string()),
            )?,
        };
        let mut compiled = compile(&step.graph, backend, options).map_err(err)?;
        let passes = std::mem::take(&mut compiled.passes);
        timings.passes = compiled.timings.passes;
        timings.lower = compiled.timings.lower;
        let graph = compiled.graph.clone();
        let fingerprint = compiled.fingerprint;
        // The trainer holds parameters and optimizer state on the host (f64) before any backend
        // sees them: say so if that cannot fit, instead of being killed mid-initialization.
        let host_values: usize = graph.inputs.iter().map(|i| graph.ty(i.value).numel()).sum();
        let host_bytes = host_values.saturating_mul(8);
        if let Some(available) = options.runtime.available_memory_bytes() {
            if host_bytes > available {
                return Err(err(format!(
                    "the train step does not fit: its parameters, optimizer state and batch are {} \
values, {} as the trainer's f64 host copies, and {} is available",
                    host_values,
                    graphtrain_runtime::mib(host_bytes),
                    graphtrain_runtime::mib(available)
                )));
            }
        }
        let ranks = match mesh.map(|m| m.launch) {
            None => Ranks::One,
            Some(Launch::Threads) => {
                let run = mesh.expect("a mesh");
                Ranks::Threads(run.threads_per_rank, Links::of(&run.links))
            }
            Some(Launch::FakeRankZero) => Ranks::FakeRankZero,
            Some(Launch::Mpi) => {
                let rank = mpi_rank()?;
                // This process's compute threads: the rank's share of its machine's cores.
                let threads = mesh.expect("a mesh").threads_per_rank;
                graphtrain_runtime::cpu::pool::Pool::for_rank(rank, threads).use_on_this_thread();
                Ranks::Mpi { rank }
            }
        };
        if let (Ranks::Mpi { .. }, Some(run)) = (ranks, mesh) {
            agree_across_ranks(&fingerprint.to_string(), model, &cfg, run)?;
        }
        let mut feeds = Vec::with_capacity(graph.inputs.len());
        let mut slots = Vec::with_capacity(graph.inputs.len());
        for input in &graph.inputs {
            // Rank 0 alone holds its own parts (initialized as if they were whole tensors); an
            // MPI rank initializes whole tensors, as the threads engine, and keeps its part.
            let ty = match ranks {
                Ranks::FakeRankZero => graph.ty(input.value).clone(),
                _ => global_input_type(&graph, input),
            };
            let keep_part = |t: HostTensor| -> Result<HostTensor, TrainError> {
                match (ranks, &graph.mesh, &input.placement) {
                    (Ranks::Mpi { rank }, Some(mesh), Some(p)) => {
                        local_part(&t, p, mesh, rank).map_err(err)
                    }
                    _ => Ok(t),
                }
            };
            let feed = match (input.kind, input.name.as_str()) {
                (InputKind::Data, "tokens") => Feed::Tokens,
                (InputKind::Data, "targets") => Feed::Targets,
                (InputKind::Data, "lr") => Feed::Lr,
                (InputKind::Data, "step") => Feed::Step,
                (InputKind::Data, other) => {
                    return Err(err(format!(
                        "the train step has a data input `{other}` the trainer cannot feed"
                    )))
                }
                (InputKind::Param | InputKind::State, _) => Feed::Carried,
            };
            let value = match input.kind {
                InputKind::Param => {
                    let (index, spec) = step
                        .params
                        .iter()
                        .enumerate()
                        .find(|(_, p)| p.name == input.name)
                        .ok_or_else(|| {
                            err(format!("parameter `{}` has no init spec", input.name))
                        })?;
                    let given =
                        imported.and_then(|m| m.initial.iter().find(|(n, _)| *n == input.name));
                    match given {
                        Some((name, value)) if value.ty != ty => {
                            return Err(err(format!(
                                "parameter `{name}`: the imported value is {} where the step \
has {ty}",
                                value.ty
                            )))
                        }
                        Some((_, value)) => value.clone(),
                        None if imported.is_some() => {
                            return Err(err(format!(
                                "parameter `{}` has no imported value",
                                input.name
                            )))
                        }
                        None => init_param(&ty, spec.init, cfg.seed, index),
                    }
                }
                _ => HostTensor::zeros(ty),
            };
            feeds.push(feed);
            slots.push(keep_part(value)?);
        }
        let position = |name: &str| {
            graph
                .outputs
                .iter()
                .position(|o| o.name == name)
                .ok_or_else(|| err(format!("the train step has no `{name}` output")))
        };
        let loss_output = position("loss")?;
        let grad_norm_output = position("grad_norm")?;
        let rss_before_load = crate::bench::current_rss_bytes();
        let t = Instant::now();
        let exec = load(compiled, ranks, &slots)?;
        timings.load = t.elapsed();
        Ok(Trainer {
            model: model.clone(),
            fingerprint,
            graph,
            timings,
            passes,
            rss_before_load,
            cfg,
            fusion: options.fusion,
            precision: options.precision,
            ranks,
            runtime: options.runtime.clone(),
            feeds,
            slots,
            loss_output,
            grad_norm_output,
            steps_done: 0,
            exec,
            slots_stale: false,
            poisoned: false,
            last_batch: None,
        })
    }

    /// Runs the following steps on `backend` (lowered in `mode`): the optimized graph is
    /// compiled again for it, without passes, and parameters and optimizer state move into its
    /// executor; only the batch, lr and step are written per step.
    pub fn use_backend(&mut self, backend: Backend, mode: Mode) -> Result<(), TrainError> {
        self.pull_slots()?;
        let no_passes = Pipeline::new(Vec::new());
        let options = CompileOptions {
            pipeline: &no_passes,
            mode,
            fusion: self.fusion,
            runtime: self.runtime.clone(),
            precision: self.precision,
        };
        let compiled = compile(&self.graph, backend, &options).map_err(err)?;
        self.timings.lower = compiled.timings.lower;
        self.rss_before_load = crate::bench::current_rss_bytes();
        let t = Instant::now();
        self.exec = load(compiled, self.ranks, &self.slots)?;
        self.timings.load = t.elapsed();
        Ok(())
    }

    /// The loaded program, when a compiled backend runs the steps.
    pub fn program(&self) -> Option<&Program> {
        self.exec.program()
    }

    /// What the backend measures its memory to hold (a device's allocator, offloaded bytes).
    pub fn measured_memory(&self) -> Option<graphtrain_runtime::MeasuredMemory> {
        self.exec.measured_memory()
    }

    /// Time by step kind, when profiling was asked for (`RuntimeOptions::profile`, compiled
    /// backends).
    pub fn profile_report(&mut self) -> Option<String> {
        self.exec.profile_report()
    }

    /// The device graphs the step replays (device backends): how many, and how many of the
    /// Program's steps they hold.
    pub fn device_graphs(&self) -> Option<(usize, usize)> {
        self.exec.device_graphs()
    }

    /// Turns timeline recording on or off for the steps that follow (each recorded step is
    /// waited for step by step, so it runs slower); `false` where the backend cannot record one.
    pub fn record_timeline(&mut self, on: bool) -> bool {
        self.exec.record_timeline(on)
    }

    /// The timeline of the last recorded step, once: one per rank, in rank order.
    /// The ranks `take_timelines` returns timelines of, as (first rank, ranks in the run): every
    /// rank from 0 in one process, or this process's own rank of an MPI job.
    pub fn timeline_ranks(&self) -> (u32, u32) {
        match self.ranks {
            Ranks::Mpi { rank } => (rank as u32, self.exec.communicator().world_size() as u32),
            _ => (0, self.exec.communicator().world_size() as u32),
        }
    }

    pub fn take_timelines(&mut self) -> Vec<Timeline> {
        self.exec.take_rank_timelines()
    }

    /// Brings parameters and state back from the executor into `slots`.
    fn pull_slots(&mut self) -> Result<(), TrainError> {
        if !self.slots_stale {
            return Ok(());
        }
        let inputs = program_inputs(self.exec.as_ref());
        for ((v, slot), feed) in inputs.into_iter().zip(&mut self.slots).zip(&self.feeds) {
            if matches!(feed, Feed::Carried) {
                *slot = self.exec.read(v).map_err(err)?;
            }
        }
        self.slots_stale = false;
        Ok(())
    }

    /// Runs one train step. A non-finite loss or grad norm stops training with an error naming
    /// the step.
    pub fn step(&mut self) -> Result<StepMetrics, TrainError> {
        let m = &self.model;
        let step_no = self.steps_done + 1;
        let tokens = m.batch * m.seq_len;
        let held = self.ranks.held_rank();
        let graph = &self.graph;
        // A rank held alone (MPI, fake) reads only its block of the batch: the rows its
        // data-parallel coordinates hold and, under sequence parallelism, its positions.
        let blocks: Vec<Option<Vec<std::ops::Range<usize>>>> = graph
            .inputs
            .iter()
            .zip(&self.feeds)
            .map(
                |(input, feed)| match (held, &graph.mesh, &input.placement, feed) {
                    (Some(rank), Some(mesh), Some(placement), Feed::Tokens | Feed::Targets) => {
                        let global = global_input_type(graph, input);
                        let block = placement
                            .local_block(mesh, &global.shape, rank)
                            .map_err(err)?;
                        Ok(Some(batch_block(block, &global.shape)?))
                    }
                    _ => Ok(None),
                },
            )
            .collect::<Result<_, _>>()?;
        let rows = blocks
            .iter()
            .flatten()
            .map(|b| b[0].clone())
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
            .unwrap_or(0..m.batch);
        let b = self
            .cfg
            .data
            .rows(
                self.cfg.seed,
                self.steps_done,
                m.batch,
                rows.clone(),
                m.seq_len,
                m.vocab_size,
            )
            .map_err(|e| err(format!("step {step_no}: {e}")))?;
        // The rows read as the slot holds them: whole, or the held rank's block of them.
        let part = |block: &Option<Vec<std::ops::Range<usize>>>, ids: &[i64]| -> Vec<f64> {
            match block {
                Some(block) => block[0]
                    .clone()
                    .flat_map(|r| {
                        let row = (r - rows.start) * m.seq_len;
                        ids[row + block[1].start..row + block[1].end].iter()
                    })
                    .map(|&t| t as f64)
                    .collect(),
                None => ids.iter().map(|&t| t as f64).collect(),
            }
        };
        for ((slot, feed), block) in self.slots.iter_mut().zip(&self.feeds).zip(&blocks) {
            match feed {
                Feed::Tokens => slot.data = part(block, &b.tokens),
                Feed::Targets => slot.data = part(block, &b.targets),
                Feed::Lr => *slot = HostTensor::scalar(slot.ty.dtype, self.cfg.lr.at(step_no)),
                Feed::Step => *slot = HostTensor::scalar(slot.ty.dtype, step_no as f64),
                Feed::Carried => {}
            }
        }
        let result =
            tracing::info_span!("step", n = step_no).in_scope(|| self.run_step(step_no, tokens));
        match &result {
            Ok(_) => {
                self.slots_stale = true;
                self.steps_done = step_no;
                // Only a whole batch is one to export for replay.
                self.last_batch = (rows == (0..self.model.batch)).then_some(b);
            }
            // Where the executor can put the donated inputs back, nothing of the failed step
            // is kept; where it updated them in place, the state is not a step's.
            Err(_) => self.poisoned |= !self.exec.undo_last_run(),
        }
        result
    }

    fn run_step(&mut self, step_no: u64, tokens: usize) -> Result<StepMetrics, TrainError> {
        let at_step = |e: graphtrain_runtime::RuntimeError| err(format!("step {step_no}: {e}"));
        let exec = self.exec.as_mut();
        let t0 = Instant::now();
        let inputs = program_inputs(exec);
        for ((v, slot), feed) in inputs.into_iter().zip(&self.slots).zip(&self.feeds) {
            if !matches!(feed, Feed::Carried) {
                exec.write(v, slot).map_err(at_step)?;
            }
        }
        exec.run().map_err(at_step)?;
        let outputs = &exec.graph().outputs;
        let (loss_value, grad_norm_value) = (
            outputs[self.loss_output].value,
            outputs[self.grad_norm_output].value,
        );
        let loss = exec.read(loss_value).map_err(at_step)?.data[0];
        let grad_norm = exec.read(grad_norm_value).map_err(at_step)?.data[0];
        let seconds = t0.elapsed().as_secs_f64();
        if !loss.is_finite() || !grad_norm.is_finite() {
            let kept = if exec.program().is_none() {
                "stopping before the update is kept"
            } else {
                "stopping (the compiled backend updates in place, so resume from the last checkpoint)"
            };
            return Err(err(format!(
                "step {step_no}: loss is {loss} (grad_norm {grad_norm}); {kept}"
            )));
        }
        Ok(StepMetrics {
            step: step_no,
            loss,
            grad_norm,
            lr: self.cfg.lr.at(step_no),
            peak_bytes: exec.memory_bytes(),
            seconds,
            tokens,
            wait_seconds: exec
                .blocked_in_waits()
                .iter()
                .map(|d| d.as_secs_f64())
                .collect(),
            peer_wait_seconds: exec
                .blocked_for_peers()
                .iter()
                .map(|d| d.as_secs_f64())
                .collect(),
        })
    }
    /// Where the training batches come from (validation reads the held-out text here).
    pub fn data(&self) -> &DataSource {
        &self.cfg.data
    }

    /// The held-out validation batches of the model's batch size, in order; an error for
    /// synthetic data (it has no held-out split) or a split smaller than one batch.
    pub fn val_batches(&self) -> Result<Vec<Batch>, TrainError> {
        match &self.cfg.data {
            DataSource::Text(t) => t.val_batches(self.model.batch).map_err(err),
            other => Err(err(format!(
                "--data {} has no held-out validation split",
                other.identity()
            ))),
        }
    }

    /// Feeds `lr` from the next step on (the steps already done keep what they used).
    pub fn set_lr_schedule(&mut self, lr: LrSchedule) {
        self.cfg.lr = lr;
    }

    /// Steps completed so far.
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// The batch step `steps_done()` trained on (`None` before the first step of this trainer).
    pub fn last_batch(&self) -> Option<&Batch> {
        self.last_batch.as_ref()
    }

    /// The whole batch step `steps_done()` trained on, also where this process read only its
    /// rank's block of it (MPI): the data is a pure function of seed and step, so the rows it
    /// did not read are read again here. `None` before the first step.
    pub fn last_whole_batch(&self) -> Result<Option<Batch>, TrainError> {
        if let Some(b) = &self.last_batch {
            return Ok(Some(b.clone()));
        }
        if self.steps_done == 0 {
            return Ok(None);
        }
        let m = &self.model;
        self.cfg
            .data
            .rows(
                self.cfg.seed,
                self.steps_done - 1,
                m.batch,
                0..m.batch,
                m.seq_len,
                m.vocab_size,
            )
            .map(Some)
            .map_err(|e| err(format!("step {}: {e}", self.steps_done)))
    }

    /// Refuses what needs whole tensors when rank 0 runs alone.
    fn need_whole_tensors(&self, what: &str) -> Result<(), TrainError> {
        if self.ranks == Ranks::FakeRankZero {
            return Err(err(format!(
                "{what}: with --launcher fake only rank 0 runs, on collectives that move no data, so it holds no whole tensor and no real run's values"
            )));
        }
        Ok(())
    }

    /// The whole tensor of input `i` from its slot: the slot itself, or on an MPI rank every
    /// rank's part gathered and assembled (a collective: every rank must call it).
    fn whole(&self, i: usize) -> Result<HostTensor, TrainError> {
        let slot = &self.slots[i];
        let input = &self.graph.inputs[i];
        match (self.ranks, &self.graph.mesh, &input.placement) {
            (Ranks::Mpi { .. }, Some(mesh), Some(placement)) => {
                let parts = mpi_all_gather(to_bytes(slot))?
                    .iter()
                    .map(|b| from_bytes(slot.ty.clone(), b))
                    .collect::<Result<Vec<_>, _>>()?;
                let refs: Vec<&HostTensor> = parts.iter().collect();
                graphtrain_ir::mesh::assemble(&refs, placement, mesh).map_err(err)
            }
            _ => Ok(slot.clone()),
        }
    }

    /// Current parameters (not optimizer state), by name, in the graph's input order.
    pub fn parameters(&mut self) -> Result<Vec<(String, HostTensor)>, TrainError> {
        self.need_whole_tensors("parameters")?;
        self.pull_slots()?;
        let mut out = Vec::new();
        for (i, input) in self.graph.inputs.iter().enumerate() {
            if input.kind == InputKind::Param {
                out.push((input.name.clone(), self.whole(i)?));
            }
        }
        Ok(out)
    }

    /// Parameters, optimizer state and the step count, with `run` to identify the run.
    pub fn checkpoint(&mut self, run: RunIdentity) -> Result<Checkpoint, TrainError> {
        self.need_whole_tensors("checkpoint")?;
        self.refuse_if_poisoned()?;
        self.pull_slots()?;
        let mut state = Vec::new();
        for (i, (input, feed)) in self.graph.inputs.iter().zip(&self.feeds).enumerate() {
            if matches!(feed, Feed::Carried) {
                state.push((input.name.clone(), self.whole(i)?));
            }
        }
        Ok(self.state_checkpoint(run, state))
    }

    /// This rank's parts of parameters and optimizer state, with each one's placement on the
    /// mesh: what an MPI rank writes into a sharded checkpoint (`sharded`). An error where the
    /// trainer holds whole tensors or no real run's values.
    pub fn checkpoint_part(
        &mut self,
        run: RunIdentity,
    ) -> Result<(Checkpoint, Vec<(String, graphtrain_ir::Placements)>), TrainError> {
        if !matches!(self.ranks, Ranks::Mpi { .. }) {
            return Err(err("a checkpoint part is written by an MPI rank only"));
        }
        self.refuse_if_poisoned()?;
        self.pull_slots()?;
        let mut state = Vec::new();
        let mut placements = Vec::new();
        for ((input, slot), feed) in self.graph.inputs.iter().zip(&self.slots).zip(&self.feeds) {
            if matches!(feed, Feed::Carried) {
                let placement = input
                    .placement
                    .clone()
                    .ok_or_else(|| err(format!("`{}` has no placement", input.name)))?;
                state.push((input.name.clone(), slot.clone()));
                placements.push((input.name.clone(), placement));
            }
        }
        Ok((self.state_checkpoint(run, state), placements))
    }

    /// After a step failed with parameters already updated in place, no state is a step's.
    fn refuse_if_poisoned(&self) -> Result<(), TrainError> {
        if self.poisoned {
            return Err(err(format!(
                "a step after step {} failed on the compiled backend, which had already updated the parameters in place; the last checkpoint written is the last good state",
                self.steps_done
            )));
        }
        Ok(())
    }

    /// A checkpoint of `state` (named tensors) after the steps done so far.
    fn state_checkpoint(&self, run: RunIdentity, state: Vec<(String, HostTensor)>) -> Checkpoint {
        let (entries, tensors) = state
            .into_iter()
            .map(|(name, t)| {
                let entry = TensorEntry {
                    name,
                    ty: t.ty.clone(),
                };
                (entry, t)
            })
            .unzip();
        Checkpoint {
            header: Header {
                run,
                steps_done: self.steps_done,
                // Batch k is a pure function of (seed, k): one batch per step.
                data_batches_consumed: self.steps_done,
                fingerprint: self.fingerprint.to_string(),
                tensors: entries,
                extra: Default::default(),
            },
            tensors,
        }
    }

    /// Whether every rank of the MPI job got `mine`: an error naming the ranks that did not (a
    /// collective: every rank must call it).
    pub fn every_rank_ok(&self, mine: &Result<(), String>) -> Result<(), TrainError> {
        let status = match mine {
            Ok(()) => Vec::new(),
            Err(e) => e.clone().into_bytes(),
        };
        let all = mpi_all_gather(status)?;
        let failed: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(r, s)| format!("rank {r}: {}", String::from_utf8_lossy(s)))
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(err(failed.join("; ")))
        }
    }

    /// On an MPI rank: its mesh, its rank and the carried tensors it holds (name, global shape,
    /// placement), for `sharded::load_parts`; `None` elsewhere.
    pub fn own_parts(&self) -> Option<(graphtrain_ir::Mesh, usize, Vec<crate::sharded::Wanted>)> {
        let (Ranks::Mpi { rank }, Some(mesh)) = (self.ranks, &self.graph.mesh) else {
            return None;
        };
        let wanted = self
            .graph
            .inputs
            .iter()
            .zip(&self.feeds)
            .filter(|(_, feed)| matches!(feed, Feed::Carried))
            .map(|(input, _)| crate::sharded::Wanted {
                name: input.name.clone(),
                global: global_input_type(&self.graph, input).shape,
                placements: input
                    .placement
                    .clone()
                    .unwrap_or_else(|| graphtrain_ir::Placements::replicated(mesh)),
            })
            .collect();
        Some((mesh.clone(), rank, wanted))
    }

    /// Continues from `ckpt`, which must come from the same run (`run`) and hold every parameter
    /// and state tensor with its type (whole, or on an MPI rank its own part). The graph
    /// fingerprint may differ (another pass pipeline over the same step): state is matched by
    /// name.
    pub fn restore(&mut self, ckpt: Checkpoint, run: &RunIdentity) -> Result<(), TrainError> {
        self.need_whole_tensors("resume")?;
        // How a step's batch is split into micro-batches changes what is live, not what the
        // step computes (up to the order of its sums): a run may go on in another split.
        let saved = RunIdentity {
            optim: OptimConfig {
                micro_batches: run.optim.micro_batches,
                ..ckpt.header.run.optim
            },
            ..ckpt.header.run.clone()
        };
        if saved != *run {
            return Err(err(describe_mismatch(&ckpt.header.run, run)));
        }
        if ckpt.header.data_batches_consumed != ckpt.header.steps_done {
            return Err(err(format!(
                "the checkpoint consumed {} batches in {} steps; this trainer takes one batch per \
step, so it cannot resume the data there",
                ckpt.header.data_batches_consumed, ckpt.header.steps_done
            )));
        }
        let steps_done = ckpt.header.steps_done;
        let mut by_name: std::collections::HashMap<String, HostTensor> =
            ckpt.named_tensors().into_iter().collect();
        for ((input, slot), feed) in self
            .graph
            .inputs
            .iter()
            .zip(&mut self.slots)
            .zip(&self.feeds)
        {
            if !matches!(feed, Feed::Carried) {
                continue;
            }
            let value = by_name
                .remove(&input.name)
                .ok_or_else(|| err(format!("the checkpoint has no tensor `{}`", input.name)))?;
            let want = global_input_type(&self.graph, input);
            let own = self.graph.ty(input.value);
            *slot = match (self.ranks, &self.graph.mesh, &input.placement) {
                // This rank's own part (`sharded::load_parts`).
                (Ranks::Mpi { .. }, Some(_), Some(_)) if value.ty == *own => value,
                (Ranks::Mpi { rank }, Some(mesh), Some(p)) if value.ty == want => {
                    local_part(&value, p, mesh, rank).map_err(err)?
                }
                _ if value.ty == want => value,
                _ => {
                    return Err(err(format!(
                        "checkpoint tensor `{}` is {}, the train step needs {}",
                        input.name, value.ty, want
                    )))
                }
            };
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(err(format!(
                "the checkpoint holds `{extra}`, which this train step does not have"
            )));
        }
        self.steps_done = steps_done;
        write_inputs(self.exec.as_mut(), &self.slots)?;
        self.slots_stale = false;
        Ok(())
    }

    /// Starts from given parameters instead of the seed's: each parameter becomes the tensor of
    /// its name in `tensors` (whole tensors of the train step's types; on an MPI rank its own
    /// part is cut from them). Optimizer state and the step count stay as built (zeros): a new
    /// run from these weights. A tensor that names no parameter is an error unless `ignore`
    /// accepts its name (a checkpoint's optimizer state); so are a missing parameter, a tensor
    /// of another type, and a call after the first step.
    pub fn init_parameters(
        &mut self,
        tensors: Vec<(String, HostTensor)>,
        ignore: impl Fn(&str) -> bool,
    ) -> Result<(), TrainError> {
        self.need_whole_tensors("initial parameters")?;
        if self.steps_done != 0 {
            return Err(err(format!(
                "initial parameters are set before the first step; {} steps are done",
                self.steps_done
            )));
        }
        self.pull_slots()?;
        let mut by_name: std::collections::HashMap<String, HostTensor> =
            tensors.into_iter().collect();
        for (input, slot) in self.graph.inputs.iter().zip(&mut self.slots) {
            if input.kind != InputKind::Param {
                continue;
            }
            let value = by_name
                .remove(&input.name)
                .ok_or_else(|| err(format!("no tensor `{}`", input.name)))?;
            let want = global_input_type(&self.graph, input);
            if value.ty != want {
                return Err(err(format!(
                    "tensor `{}` is {}, the train step's parameter is {want}",
                    input.name, value.ty
                )));
            }
            *slot = match (self.ranks, &self.graph.mesh, &input.placement) {
                (Ranks::Mpi { rank }, Some(mesh), Some(p)) => {
                    local_part(&value, p, mesh, rank).map_err(err)?
                }
                _ => value,
            };
        }
        let mut extra: Vec<&String> = by_name.keys().filter(|name| !ignore(name)).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(err(format!(
                "it holds `{name}`{}, which is not a parameter of this train step",
                match extra.len() {
                    1 => String::new(),
                    n => format!(" and {} more", n - 1),
                }
            )));
        }
        write_inputs(self.exec.as_mut(), &self.slots)
    }

    /// Current value of the input named `name` (a parameter, a state tensor).
    pub fn input_value(&mut self, name: &str) -> Option<&HostTensor> {
        self.pull_slots().ok()?;
        let i = self.graph.inputs.iter().position(|i| i.name == name)?;
        Some(&self.slots[i])
    }
}

/// Refuses text cut for another sequence length, or with ids the model's embedding cannot hold.
/// A tokenizer smaller than the model's vocab is fine: the extra embedding rows go unused.
fn check_text_fits(text: &crate::data::TextData, model: &Llama3Config) -> Result<(), TrainError> {
    if text.seq_len() != model.seq_len {
        return Err(err(format!(
            "the text was cut into rows for seq_len {}, the model config has seq_len {}",
            text.seq_len(),
            model.seq_len
        )));
    }
    if text.vocab_size() > model.vocab_size {
        return Err(err(format!(
            "the tokenizer's vocab size {} is larger than the model config's vocab_size {}: token ids would fall outside the embedding",
            text.vocab_size(),
            model.vocab_size
        )));
    }
    Ok(())
}

/// Names the first field in which two run identities differ.
fn describe_mismatch(saved: &RunIdentity, now: &RunIdentity) -> String {
    let field = if saved.model != now.model {
        let a = ron::to_string(&saved.model).unwrap_or_default();
        let b = ron::to_string(&now.model).unwrap_or_default();
        format!("the model config (checkpoint {a}, now {b})")
    } else if saved.seed != now.seed {
        format!("--seed (checkpoint {}, now {})", saved.seed, now.seed)
    } else if saved.data != now.data {
        format!("--data (checkpoint {}, now {})", saved.data, now.data)
    } else {
        format!(
            "the optimizer (checkpoint {:?}, now {:?})",
            saved.optim, now.optim
        )
    };
    format!("the checkpoint comes from a different run: {field} differs")
}
