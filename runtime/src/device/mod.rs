//! The device backends, `wgpu` and `cuda`: a Program run on a GPU through cubecl. One arena
//! buffer in device memory holds every value, as on the cpu backend.
//!
//! - Map, copy and reduce steps launch the shared kernels (`shared/kernels.rs`, through
//!   `shared/launches.rs`) at vector width 4 over a grid of 64-unit cubes;
//! - matmul, gather and scatter-add launch `kernels.rs`; gather and scatter-add (and
//!   cross-entropy's targets) are checked before the step runs, so a bad index is an error
//!   naming the step and position, never a silent wrong value: by the host as it writes the
//!   input the indices are (token ids, targets: `index_checks.rs`), else by a kernel whose flag
//!   is read back;
//! - iota and random values are computed on the host and written into the arena;
//! - a collective (on a mesh) runs on NCCL on `cuda` (`nccl.rs`: device to device, on a stream
//!   of its own; built, not yet run on a GPU); elsewhere, or with
//!   `DeviceCollectives::Host`, it is staged through host memory: its start reads the operand
//!   back, hands it to the rank's communicator (threads or MPI, as on `cpu`), and its wait
//!   writes the result into the arena. Correct on every device, and as slow as two copies
//!   over the bus;
//! - the composites the lowering keeps as one step (attention and its backward, rope,
//!   cross-entropy and its backward, AdamW) launch `composites.rs`. Their rope angle
//!   tables (written once at load) and the per-row statistics of their reductions (scratch that
//!   every step reuses) live in the arena's tail, past the flag (`Tail`);
//! - the capture pass's regions: their runs of launch-only steps are recorded as device graphs
//!   in the second run and replayed after (`graphs.rs`; `RuntimeOptions::device_graphs`).
//!
//! What is not done yet: the kernels are simple (one unit per output, or 16 x 16 output tiles
//! for the matmul; no tensor cores), so this backend is correct, not fast. It is tested on
//! Mesa's lavapipe (a Vulkan driver running on the CPU); `cuda` is built (`cargo check
//! --features cuda`) but has not run here.
//!
//! Ordering: every launch queues on the client's one stream, in step order; reads and host
//! writes go through the same stream, so each sees the launches before it (a device graph
//! replays on the stream that recorded it, and only from that thread).

pub mod composites;
mod graphs;
mod index_checks;
pub mod kernels;
#[cfg(feature = "cuda")]
mod nccl;
pub mod nccl_plan;

use crate::options::{DeviceCollectives, DeviceGraphs, DeviceMatmul, Profile, RuntimeOptions};
use crate::shared::attention_shape::{attention_dims, Dims};
use crate::shared::kernel_call::{grid, Binding};
use crate::shared::launches::{Grid, Launches};
use crate::shared::profile::{profile_key, profile_report, ProfileEntry};
use crate::shared::rope_tables::{TableKey, Tables};
use crate::shared::{check_input, iota_value, random_value};
use crate::timeline::{self, Recorder, Timeline};
use crate::{Communicator, Executor, RuntimeError};
use composites::{
    adamw_kernel, attention_dq_kernel, attention_kernel, attention_kv_backward_kernel,
    cross_entropy_backward_kernel, cross_entropy_rows_kernel, mean_kernel, rope_kernel,
    AttentionShapeLaunch, Heads4Launch,
};
use cubecl::prelude::*;
use graphtrain_ir::{Graph, HostTensor, ValueId};
use graphtrain_lowering::program::contiguous_strides;
use graphtrain_lowering::{Program, Step, View};
use index_checks::{INDEX, TARGET};
use kernels::{
    check_indices_kernel, gather_kernel, matmul_kernel, matmul_tiled_kernel, scatter_add_kernel,
};
use std::collections::HashMap;
use std::time::Instant;

/// The widest vector the map kernels read on a device (WGSL's `vec4`).
const VECTOR: usize = 4;
/// Units per cube on a device, and the most units one launch uses (a grid-stride loop covers
/// the rest). wgpu caps a dispatch at 65535 cubes per dimension.
const CUBE: usize = 64;
const MAX_UNITS: usize = CUBE * 4096;

/// One unit per 4 outputs of a map, copy or reduction, in whole cubes once past one cube.
const DEVICE_GRID: Grid = Grid {
    vector: VECTOR,
    map_vector: VECTOR,
    units: |work, _| units_for(work.div_ceil(4)),
    guard_ops: true,
};

/// Units for `work` independent outputs: up to one per output, whole cubes past 256.
fn units_for(work: usize) -> u32 {
    let units = work.clamp(1, MAX_UNITS);
    if units <= 256 {
        units as u32
    } else {
        units.next_multiple_of(CUBE) as u32
    }
}

/// Which device a device backend runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Wgpu,
    Cuda,
}

impl DeviceKind {
    fn name(self) -> &'static str {
        match self {
            DeviceKind::Wgpu => "wgpu",
            DeviceKind::Cuda => "cuda",
        }
    }

    /// The device, or what is missing and how to get it.
    pub fn device(self) -> Result<cubecl::Device, RuntimeError> {
        self.device_at(0)
    }

    /// Which of this kind's devices rank index `index` opens: `cuda` wraps the index around
    /// the GPUs present (one rank a GPU where there are as many); `wgpu` opens its default
    /// adapter.
    pub fn ordinal(self, index: usize) -> Result<usize, RuntimeError> {
        Ok(index % self.count()?)
    }

    /// How many devices of this kind there are (`wgpu`: its one default adapter).
    fn count(self) -> Result<usize, RuntimeError> {
        match self {
            DeviceKind::Wgpu => Ok(1),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                use cudarc::driver::result as cu;
                // cudarc loads the driver on first use and panics without one; the caller
                // has opened device 0 by now, so a panic here is not expected, only guarded.
                let count =
                    std::panic::catch_unwind(|| cu::init().and_then(|()| cu::device::get_count()))
                        .map_err(|_| "the CUDA driver could not be loaded".to_string())
                        .and_then(|r| r.map_err(|e| format!("{e:?}")))
                        .map_err(|e| {
                            RuntimeError::Unavailable(format!(
                                "backend `cuda` could not count the GPUs: {e}"
                            ))
                        })?;
                Ok(count.max(1) as usize)
            }
            // Without `cuda` compiled in, opening the device fails first.
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => Ok(1),
        }
    }

    /// Device `ordinal` of this kind (`device_at(0)` is `device()`).
    pub fn device_at(self, ordinal: usize) -> Result<cubecl::Device, RuntimeError> {
        use cubecl::device::{DeviceUnavailable, WgpuDeviceKind};
        let found = match self {
            DeviceKind::Wgpu => cubecl::Device::wgpu(WgpuDeviceKind::default()),
            DeviceKind::Cuda => cubecl::Device::cuda(ordinal),
        };
        found.map_err(|e| {
            RuntimeError::Unavailable(match (self, e) {
                (DeviceKind::Wgpu, DeviceUnavailable::NotLinked(_)) => {
                    "backend `wgpu` is not compiled into this graphtrain: rebuild with its \
default features (`--features wgpu`). Or use --backend cpu."
                        .into()
                }
                (DeviceKind::Cuda, DeviceUnavailable::NotLinked(_)) => {
                    "backend `cuda` is not compiled into this graphtrain: rebuild with \
`--features cuda` on a machine with an NVIDIA GPU and driver. Or use --backend cpu."
                        .into()
                }
                (DeviceKind::Wgpu, DeviceUnavailable::NoSuchDevice { .. }) => {
                    "backend `wgpu` found no GPU adapter: it needs a Vulkan, Metal or DX12 \
driver; on a machine without a GPU, install Mesa's lavapipe (Debian packages \
mesa-vulkan-drivers and libvulkan1). Or use --backend cpu."
                        .into()
                }
                (DeviceKind::Cuda, DeviceUnavailable::NoSuchDevice { .. }) => {
                    "backend `cuda` found no NVIDIA GPU: it needs one and its driver \
(libcuda). Or use --backend cpu."
                        .into()
                }
            })
        })
    }
}

pub struct DeviceExecutor {
    program: Program,
    kind: DeviceKind,
    client: Client,
    /// The arena's buffers with their lengths in elements: one holding the Program's values
    /// and the tail, or, where one binding holds less (`window`), one per window of the
    /// arena and one for the tail.
    buffers: Vec<(cubecl::server::Handle, usize)>,
    /// Elements per window, when the arena is split across buffers: the plan keeps every
    /// value inside one window (`Program::plan_in_windows`), so each operand is one binding.
    window: Option<usize>,
    /// Elements of the arena the Program addresses; the index-check flag lives right after.
    len: usize,
    /// What lies past the flag, and the buffer's size in elements.
    tail: Tail,
    /// With a `Profile` asked for, every step is waited for and timed (after the first run,
    /// which compiles the kernels).
    profile: Option<Vec<ProfileEntry>>,
    /// Present while timeline recording is on: one `Option` test per step otherwise.
    timeline: Option<Recorder>,
    runs: usize,
    /// The last value written from the host into each one-element input that no output
    /// replaces (the step count, the learning rate): what a host-side computation reads
    /// without waiting for the device.
    host_scalars: HashMap<ValueId, f32>,
    comm: Box<dyn Communicator>,
    /// Collectives in flight, by handle id: the operand and result in host memory, where the
    /// communicator reads and writes them (`Staged`).
    staged: HashMap<usize, Staged>,
    /// Offloaded values (`Program::host_values`) in host memory, from their offload to the next
    /// run's: the arena holds no bytes for them.
    host: HashMap<ValueId, Vec<f32>>,
    /// What the device's allocator reported the arena to take when it was created (its bytes
    /// in use after, less before): the measurement the plan's arena is checked against.
    arena_measured: u64,
    /// Matmuls launch `matmul_tiled_kernel` (else `matmul_kernel`).
    tiled_matmul: bool,
    /// The loop trips a unit may take before the device leaves its loops early (llvmpipe's
    /// 65535), measured at load; `None` where a probe past that ran to its end.
    loop_budget: Option<usize>,
    /// The capture regions' segments recorded as device graphs (`graphs.rs`); empty with
    /// `DeviceGraphs::Off`.
    segments: Vec<graphs::Segment>,
    /// The thread whose stream recorded the graphs: they replay on that stream only.
    graph_thread: Option<std::thread::ThreadId>,
    /// Index checks the host makes as it writes an input (`index_checks.rs`), by input, and
    /// the steps they stand in for (which then read no flag back).
    write_checks: HashMap<ValueId, Vec<index_checks::WriteCheck>>,
    checked_on_write: std::collections::HashSet<usize>,
    /// The AdamW steps whose step count the host writes: their bias corrections are written at
    /// the start of each run (the others' when the step runs).
    corrections_at_start: Vec<usize>,
    /// Collectives through NCCL (`cuda` with several ranks), else staged through the host.
    #[cfg(feature = "cuda")]
    nccl: Option<NcclRank>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    collective_timeout: std::time::Duration,
}

/// A rank's NCCL groups, and the arena's device address kept valid while they use it.
#[cfg(feature = "cuda")]
struct NcclRank {
    // Dropped first: NCCL's stream finishes before the arena's address is released.
    world: nccl::Nccl,
    _arena: Box<dyn std::any::Any + Send>,
}

/// A collective's operand and result copied out of the device arena: the communicators move
/// host memory (shared memory between threads, MPI between processes), so a device rank stages
/// its collectives through the host. Both vectors stay put (and unread by anything else) from
/// the start until the wait.
struct Staged {
    src: Vec<f32>,
    dst: Vec<f32>,
}

impl DeviceExecutor {
    pub fn new(
        program: Program,
        kind: DeviceKind,
        options: RuntimeOptions,
        comm: Box<dyn Communicator>,
    ) -> Result<Self, RuntimeError> {
        // The first device answers whether the kind is here at all, with its own errors.
        kind.device()?;
        let ordinal = kind.ordinal(options.device_index.unwrap_or(comm.rank()))?;
        let device = kind.device_at(ordinal)?;
        let client = open(&device, kind)?;
        let mut program = program;
        // The most elements one buffer holds: the device's binding limit (or the option's, if
        // lower), in 32-bit element indices, in whole 64-element blocks (the arena's 256-byte
        // alignment and whole vectors).
        let device_max = client.properties().memory.max_page_size;
        let max_bytes = options
            .device_buffer_bytes
            .map_or(device_max, |b| (b as u64).min(device_max));
        let max_elems = ((max_bytes / 4).min(u32::MAX as u64) as usize) / 64 * 64;
        // Whole vectors, plus one vector holding the index-check flag, then the tail.
        let mut len = program.arena_elems().next_multiple_of(VECTOR);
        let (mut tail, mut tables) = Tail::plan(&program, len + VECTOR);
        let mut window = None;
        if tail.end > max_elems {
            let single = program.plan.to_string();
            let does_not_fit = |why: String| {
                RuntimeError::DoesNotFit(format!(
                    "the program does not fit: {why}, and one buffer on this {} device holds \
at most {} (the buffer plan: {single})",
                    kind.name(),
                    crate::mib(max_elems * 4)
                ))
            };
            if max_elems == 0 {
                return Err(does_not_fit("no buffer".into()));
            }
            program
                .plan_in_windows(max_elems * 4)
                .map_err(&does_not_fit)?;
            len = program.arena_elems().next_multiple_of(VECTOR);
            (tail, tables) = Tail::plan(&program, len + VECTOR);
            if tail.end - len > max_elems {
                return Err(does_not_fit(format!(
                    "the composites' tables and scratch take {}",
                    crate::mib((tail.end - len) * 4)
                )));
            }
            window = Some(max_elems);
        }
        let sizes: Vec<usize> = match window {
            None => vec![tail.end],
            Some(w) => (0..len.div_ceil(w))
                .map(|i| w.min(len - i * w))
                .chain([tail.end - len])
                .collect(),
        };
        let in_use = || {
            client
                .memory_report(cubecl::MemoryScope::Device)
                .usage()
                .bytes_in_use
        };
        let before = in_use();
        let buffers = sizes
            .iter()
            .map(|&n| (client.create_from_slice(&vec![0u8; n * 4]), n))
            .collect();
        let arena_measured = in_use().saturating_sub(before);
        let constants = program.constants.clone();
        let mut exec = DeviceExecutor {
            program,
            kind,
            client,
            buffers,
            window,
            len,
            tail,
            profile: (options.profile != Profile::Off).then(Vec::new),
            timeline: options.timeline.then(Recorder::default),
            runs: 0,
            host_scalars: HashMap::new(),
            comm,
            staged: HashMap::new(),
            host: HashMap::new(),
            arena_measured,
            tiled_matmul: match options.device_matmul {
                DeviceMatmul::Tiled => true,
                DeviceMatmul::PerOutput => false,
                DeviceMatmul::Auto => kind == DeviceKind::Cuda,
            },
            loop_budget: None,
            segments: Vec::new(),
            graph_thread: None,
            write_checks: HashMap::new(),
            checked_on_write: Default::default(),
            corrections_at_start: Vec::new(),
            #[cfg(feature = "cuda")]
            nccl: None,
            collective_timeout: options.collective_timeout(),
        };
        exec.corrections_at_start = (exec.program.steps.iter().enumerate())
            .filter_map(|(i, s)| match s {
                Step::AdamW { step: t, .. } if graphs::written_by_host(&exec.program, *t) => {
                    Some(i)
                }
                _ => None,
            })
            .collect();
        exec.loop_budget = exec.probe_loop_budget()?;
        if let Some(budget) = exec.loop_budget {
            for (i, step) in exec.program.steps.iter().enumerate() {
                let trips = exec.loop_trips(step)?;
                if trips > budget {
                    return Err(RuntimeError::Unavailable(format!(
                        "step {i} ({}) takes up to {trips} loop trips in one kernel unit, and this \
{} device leaves a shader's loops after {budget} (llvmpipe's limit), which would give a wrong \
answer: a smaller shape (batch, sequence, vocabulary), or a GPU",
                        step.kind(),
                        kind.name()
                    )));
                }
            }
        }
        exec.write_checks = index_checks::plan(&exec.program);
        exec.checked_on_write = exec
            .write_checks
            .values()
            .flatten()
            .map(|c| c.step)
            .collect();
        if options.device_graphs == DeviceGraphs::On {
            exec.segments = graphs::segments(&exec.program, &exec.checked_on_write);
        }
        let nccl = match options.device_collectives {
            DeviceCollectives::Host => false,
            // NCCL refuses two ranks on one GPU: by default it is used where every rank can
            // have its own (as many GPUs here as ranks), a rule every rank of a uniform job
            // decides alike. A job spanning machines asks for it (device_collectives=nccl).
            DeviceCollectives::Auto => {
                let world = exec.comm.world_size();
                kind == DeviceKind::Cuda && world > 1 && kind.count()? >= world
            }
            DeviceCollectives::Nccl => {
                if kind != DeviceKind::Cuda {
                    return Err(RuntimeError::Unavailable(format!(
                        "NCCL collectives are the cuda backend's; the {} backend moves \
collectives through host memory (device_collectives=host or auto)",
                        kind.name()
                    )));
                }
                exec.comm.world_size() > 1
            }
        };
        if nccl {
            if let Err(e) = exec.join_nccl(ordinal) {
                // The other ranks may be waiting in the bootstrap's broadcast: release them.
                exec.comm.abort(&e.to_string());
                return Err(e);
            }
        }
        for (v, t) in &constants {
            exec.write(*v, t)?;
        }
        for (key, t) in &tables {
            let at = exec.tail.rope[key];
            exec.write_floats(at, &t.cos);
            exec.write_floats(at + t.cos.len(), &t.sin);
        }
        Ok(exec)
    }

    fn off(&self, v: ValueId) -> usize {
        self.program.elem_offset(v)
    }

    /// The buffer holding arena element `at` (a flag or tail element past the Program's
    /// values is in the tail's).
    fn locate(&self, at: usize) -> Binding {
        let (i, base) = match self.window {
            None => (0, 0),
            Some(_) if at >= self.len => (self.buffers.len() - 1, self.len),
            Some(w) => (at / w, at / w * w),
        };
        Binding {
            handle: self.buffers[i].0.clone(),
            elems: self.buffers[i].1,
            base,
        }
    }

    /// The operand at arena element `at` as a launch binds it: its buffer, and `at` inside it.
    fn operand(&self, at: usize) -> (BufferArg, usize) {
        let b = self.locate(at);
        // SAFETY: the buffer holds `b.elems` floats; every launch addresses inside it (the
        // planner keeps each operand inside one buffer).
        let arg = unsafe { BufferArg::from_raw_parts(b.handle, b.elems) };
        (arg, at - b.base)
    }

    /// An attention operand as its kernels take it: its buffer, and offset and four strides
    /// inside it.
    fn heads4(&self, (at, s): (usize, [usize; 4])) -> (BufferArg, Heads4Launch) {
        let (buffer, at) = self.operand(at);
        (buffer, Heads4Launch::new(at, s[0], s[1], s[2], s[3]))
    }

    #[cfg(feature = "cuda")]
    fn join_nccl(&mut self, ordinal: usize) -> Result<(), RuntimeError> {
        type Server = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;
        if self.window.is_some() {
            return Err(RuntimeError::Unavailable(format!(
                "NCCL collectives address the arena as one device buffer, and this program's \
is split across {} (device_collectives=host moves collectives through host memory)",
                self.buffers.len()
            )));
        }
        let arena = self
            .client
            .get_resource::<Server>(self.buffers[0].0.clone())
            .map_err(|e| {
                RuntimeError::Backend(format!("NCCL: the arena's device address: {e:?}"))
            })?;
        let address = arena.resource().ptr;
        let world = nccl::Nccl::join(
            &self.program,
            self.comm.as_ref(),
            ordinal,
            address,
            self.collective_timeout,
        )?;
        self.nccl = Some(NcclRank {
            world,
            _arena: Box::new(arena),
        });
        Ok(())
    }

    /// Rounds the arena's elements `at..at + len` to bf16 (a bf16 sum NCCL made in f32).
    #[cfg(feature = "cuda")]
    fn round_to_bf16(&self, at: usize, len: usize) {
        let (count, dim) = grid(units_for(len));
        let (buffer, at) = self.operand(at);
        // SAFETY: the range is a collective's result inside the arena.
        unsafe {
            kernels::round_bf16_kernel::launch_unchecked(&self.client, count, dim, buffer, at, len)
        };
    }

    #[cfg(not(feature = "cuda"))]
    fn join_nccl(&mut self, _ordinal: usize) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unavailable(
            "NCCL collectives need graphtrain built with `--features cuda`".to_string(),
        ))
    }

    /// The loop trips a unit of this device takes before its loops are left early, or `None`
    /// when a probe of one more than llvmpipe's limit runs to its end. One launch and one read
    /// of the index-check flag's slot, at load.
    fn probe_loop_budget(&self) -> Result<Option<usize>, RuntimeError> {
        let want = crate::shared::kernels::LOOP_BUDGET + 1;
        let (buffer, at) = self.operand(self.len);
        // SAFETY: the flag's slot lies inside its buffer.
        unsafe {
            kernels::loop_probe_kernel::launch_unchecked(
                &self.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                buffer,
                at,
                want,
            )
        };
        let trips = self.read_floats(self.len, 1)?[0] as usize;
        self.write_floats(self.len, &[0.0]);
        Ok((trips < want).then_some(trips))
    }

    /// At most how many loop trips one unit of `step`'s launches takes, every loop of the
    /// kernel counted (`KernelCall::loop_trips` for the shared kernels; the loops of
    /// `kernels.rs` and `composites.rs` here). Steps that launch nothing count 0.
    fn loop_trips(&self, step: &Step) -> Result<usize, RuntimeError> {
        let launches = Launches {
            program: &self.program,
            grid: DEVICE_GRID,
        };
        if let Some(calls) = launches.kernel_calls(step)? {
            return Ok(calls.iter().map(|c| c.loop_trips()).max().unwrap_or(0));
        }
        let g = &self.program.graph;
        // A unit's share of `work` outputs taken a grid-stride apart.
        let share = |work: usize| work.div_ceil(units_for(work) as usize);
        Ok(match step {
            Step::Matmul { k, .. } if self.tiled_matmul => k.div_ceil(16) * 17,
            Step::Matmul { batch, m, n, k, .. } => share(batch * m * n) * (k + 1),
            Step::Gather { index, .. } => share(g.ty(*index).numel()),
            Step::ScatterAdd { src, index, .. } => {
                let along = g.ty(*index).shape.iter().copied().max().unwrap_or(0);
                share(g.ty(*src).numel()) * (along + 1)
            }
            Step::CrossEntropy { logits, .. } | Step::CrossEntropyBackward { logits, .. } => {
                let rows = logits.shape.first().copied().unwrap_or(0);
                let cols = logits.shape.get(1).copied().unwrap_or(0);
                // The rows' statistics (two passes over a row), then the mean over the rows.
                (share(rows) * (2 * cols + 2)).max(rows + 1)
            }
            Step::Attention { q, k, causal, .. } | Step::AttentionBackward { q, k, causal, .. } => {
                let d = attention_dims(q, k, *causal, 1.0)?;
                let s = d.seq;
                let rows = d.batch * d.heads * s;
                // Loops over a head's elements are unrolled (`d` is comptime). Per query row:
                // the softmax's pass over the keys, then one more (forward) or two (the query
                // side of backward); per key row, one head's query rows.
                match step {
                    Step::Attention { .. } => share(rows) * (1 + 2 * s),
                    _ => {
                        // One launch per query head of a group for the keys' half.
                        let queries = share(rows) * (1 + 3 * s);
                        let keys = share(d.batch * d.kv_heads * s) * (1 + s);
                        queries.max(keys)
                    }
                }
            }
            Step::Rope { x, .. } => share(x.shape.iter().product::<usize>() / 2),
            Step::AdamW { updates, .. } => updates
                .iter()
                .map(|u| share(g.ty(u.p).numel()))
                .max()
                .unwrap_or(0),
            _ => 0,
        })
    }

    /// Waits for every queued launch.
    fn sync(&self) -> Result<(), RuntimeError> {
        cubecl::future::block_on(self.client.sync()).map_err(|e| {
            RuntimeError::Backend(format!("a {} kernel failed: {e:?}", self.kind.name()))
        })
    }

    /// The arena's elements `start..start + n` (inside one buffer), as a handle for reads and
    /// writes.
    fn range(&self, start: usize, n: usize) -> cubecl::server::Handle {
        let b = self.locate(start);
        let at = start - b.base;
        b.handle
            .offset_start((at * 4) as u64)
            .offset_end(((b.elems - at - n) * 4) as u64)
    }

    fn write_floats(&self, start: usize, data: &[f32]) {
        if data.is_empty() {
            return;
        }
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.client.write(
            &self.range(start, data.len()),
            cubecl::bytes::Bytes::from_bytes_vec(bytes),
        );
    }

    /// Writes AdamW step `i`'s bias corrections into its slot, as the cpu backend computes them,
    /// on the host: a device's `powf` may be a few ulp off near 1 (lavapipe's: `0.999^1` gave
    /// 0.99899989), and `1 - beta^t` turns that into a 1e-4 error of every update.
    fn write_corrections(&self, i: usize, step: &Step) -> Result<(), RuntimeError> {
        let Step::AdamW {
            step: t,
            beta1,
            beta2,
            ..
        } = step
        else {
            return Ok(());
        };
        let (beta1, beta2) = (*beta1, *beta2);
        let t = self.host_scalar(*t)?;
        let bc1 = 1.0 - (beta1 as f32).powf(t);
        let bc2 = 1.0 - (beta2 as f32).powf(t);
        self.write_floats(self.tail.corrections[&i], &[bc1, bc2.sqrt()]);
        Ok(())
    }

    /// A one-element value: as the host last wrote it, or else read back from the device.
    fn host_scalar(&self, v: ValueId) -> Result<f32, RuntimeError> {
        match self.host_scalars.get(&v) {
            Some(x) => Ok(*x),
            None => Ok(self.read_floats(self.off(v), 1)?[0]),
        }
    }

    fn read_floats(&self, start: usize, n: usize) -> Result<Vec<f32>, RuntimeError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let bytes = self
            .client
            .read_one(self.range(start, n))
            .map_err(|e| RuntimeError::Backend(format!("reading from the device failed: {e:?}")))?;
        Ok(bytes[..n * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Launches the index check over `n` indices at `index` (`stride` apart) and fails, naming
    /// step `i`, when one is out of `0..bound`. `what` names an index and its position in the
    /// error, as `("index", "position")`.
    #[allow(clippy::too_many_arguments)]
    fn check_indices(
        &self,
        i: usize,
        step: &Step,
        index: usize,
        stride: usize,
        n: usize,
        bound: usize,
        what: (&str, &str),
    ) -> Result<(), RuntimeError> {
        if n == 0 {
            return Ok(());
        }
        let (count, dim) = grid(units_for(n));
        let (index_buf, index_at) = self.operand(index);
        let (flag_buf, flag_at) = self.operand(self.len);
        // SAFETY: the indices and the flag lie inside their buffers.
        unsafe {
            check_indices_kernel::launch_unchecked(
                &self.client,
                count,
                dim,
                index_buf,
                flag_buf,
                index_at,
                stride,
                n,
                bound as f32,
                flag_at,
            )
        };
        let flag = self.read_floats(self.len, 1)?[0];
        if flag == 0.0 {
            return Ok(());
        }
        self.write_floats(self.len, &[0.0]);
        let pos = flag as usize - 1;
        let x = self.read_floats(index + pos * stride, 1)?[0];
        Err(RuntimeError::Input(format!(
            "step {i} ({}): {} {x} at {} {pos} is out of range 0..{bound}",
            step.kind(),
            what.0,
            what.1
        )))
    }

    /// Runs `segment` by replaying its graph, or, from the second run on, dispatches it inside
    /// cubecl's warmup window (this run's work) and records it. Returns whether its steps have
    /// run; `false` leaves them to be dispatched.
    fn replay_or_record(
        &mut self,
        segment: &mut graphs::Segment,
        steps: &[Step],
    ) -> Result<bool, RuntimeError> {
        let range = segment.steps.clone();
        match &segment.state {
            graphs::State::Recorded(graph) => {
                // SAFETY: the recorded launches address the arena, which lives as long as
                // `self`; no other stream uses it; inputs were written on this thread's stream
                // (the caller replays only on the recording thread), which orders the replay
                // behind them, and reads after it.
                unsafe { graph.replay() }.map_err(|e| {
                    RuntimeError::Backend(format!(
                        "replaying steps {range:?} as a {} graph failed: {e:?}",
                        self.kind.name()
                    ))
                })?;
                Ok(true)
            }
            graphs::State::Refused => Ok(false),
            graphs::State::Waiting if self.runs == 0 => Ok(false),
            graphs::State::Waiting => {
                let dispatch =
                    |this: &mut Self| range.clone().try_for_each(|i| this.run_step(i, &steps[i]));
                let refused = |what: &str, e: &dyn std::fmt::Debug| {
                    tracing::warn!(
                        "steps {range:?} stay dispatched: {what} refused recording them as a device graph: {e:?}"
                    );
                    graphs::State::Refused
                };
                if let Err(e) = self.client.graph_prepare() {
                    segment.state = refused("preparing", &e);
                    return Ok(false);
                }
                // The warmup cubecl asks for is this run's dispatch of the steps.
                if let Err(e) = dispatch(self) {
                    let _ = self.client.stop_capture();
                    return Err(e);
                }
                if let Err(e) = self.client.start_capture() {
                    let _ = self.client.stop_capture();
                    segment.state = refused("opening the window", &e);
                    return Ok(true);
                }
                let launched = dispatch(self);
                let graph = self.client.stop_capture();
                segment.state = match (launched, graph) {
                    (Ok(()), Ok(graph)) => graphs::State::Recorded(graph),
                    (Err(e), _) => return Err(e),
                    (Ok(()), Err(e)) => refused("closing the window", &e),
                };
                Ok(true)
            }
        }
    }

    fn run_step(&mut self, i: usize, step: &Step) -> Result<(), RuntimeError> {
        let launches = Launches {
            program: &self.program,
            grid: DEVICE_GRID,
        };
        if let Some(calls) = launches.kernel_calls(step)? {
            for call in &calls {
                // SAFETY: every offset + count is inside the arena (the planner sized it), and
                // every operand inside one of its buffers (the planner's windows).
                unsafe { call.dispatch(&self.client, &|at| self.locate(at))? };
            }
            return Ok(());
        }
        let g = &self.program.graph;
        match step {
            Step::Matmul {
                out,
                a,
                b,
                batch,
                m,
                n,
                k,
                bf16,
            } => {
                let total = batch * m * n;
                if total == 0 {
                    return Ok(());
                }
                let (a_buf, ao) = self.operand(self.off(a.base) + a.offset);
                let (b_buf, bo) = self.operand(self.off(b.base) + b.offset);
                let (c_buf, co) = self.operand(self.off(*out));
                // bf16-mixed: bf16 operands (held in f32 slots) summed in f32, rounded once.
                let round_bf16 = u32::from(bf16.out);
                let round_in = round_bf16 * (u32::from(bf16.a) | (u32::from(bf16.b) << 1));
                if self.tiled_matmul {
                    let count = CubeCount::Static(
                        n.div_ceil(16) as u32,
                        m.div_ceil(16) as u32,
                        *batch as u32,
                    );
                    // SAFETY: as for `matmul_kernel` below; units past `m` or `n` read and
                    // write nothing.
                    unsafe {
                        matmul_tiled_kernel::launch_unchecked(
                            &self.client,
                            count,
                            CubeDim::new_2d(16, 16),
                            a_buf,
                            b_buf,
                            c_buf,
                            ao,
                            a.strides[0],
                            a.strides[1],
                            a.strides[2],
                            bo,
                            b.strides[0],
                            b.strides[1],
                            b.strides[2],
                            co,
                            *m,
                            *n,
                            *k,
                            round_bf16,
                            round_in,
                        )
                    };
                    return Ok(());
                }
                let (count, dim) = grid(units_for(total));
                // SAFETY: the views and the output lie inside the arena, the output apart from
                // its operands (the planner never places an output over a live operand).
                unsafe {
                    matmul_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        a_buf,
                        b_buf,
                        c_buf,
                        ao,
                        a.strides[0],
                        a.strides[1],
                        a.strides[2],
                        bo,
                        b.strides[0],
                        b.strides[1],
                        b.strides[2],
                        co,
                        *m,
                        *n,
                        *k,
                        total,
                        round_bf16,
                        round_in,
                    )
                };
            }
            Step::Gather {
                out,
                src,
                index,
                axis,
            } => {
                let sshape = &g.ty(*src).shape;
                let ishape = &g.ty(*index).shape;
                let total: usize = ishape.iter().product();
                let (io, so, oo) = (self.off(*index), self.off(*src), self.off(*out));
                if !self.checked_on_write.contains(&i) {
                    self.check_indices(i, step, io, 1, total, sshape[*axis], INDEX)?;
                }
                if total == 0 {
                    return Ok(());
                }
                let (n, s, s_axis) = padded_dims(ishape, sshape, *axis, step)?;
                let (count, dim) = grid(units_for(total));
                let (src_buf, so) = self.operand(so);
                let (index_buf, io) = self.operand(io);
                let (out_buf, oo) = self.operand(oo);
                // SAFETY: source, indices and output lie inside the arena, the output apart.
                unsafe {
                    gather_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        src_buf,
                        index_buf,
                        out_buf,
                        so,
                        io,
                        oo,
                        n[1],
                        n[2],
                        n[3],
                        s[0],
                        s[1],
                        s[2],
                        s[3],
                        s_axis,
                        sshape[*axis],
                        total,
                    )
                };
            }
            Step::ScatterAdd {
                out,
                src,
                index,
                add,
                axis,
            } => {
                let sshape = &g.ty(*src).shape;
                let ishape = &g.ty(*index).shape;
                let io = self.off(*index);
                if !self.checked_on_write.contains(&i) {
                    self.check_indices(
                        i,
                        step,
                        io,
                        1,
                        ishape.iter().product(),
                        sshape[*axis],
                        INDEX,
                    )?;
                }
                let total: usize = sshape.iter().product();
                if total == 0 {
                    return Ok(());
                }
                if sshape.len() > 4 {
                    return Err(too_many_dims(step, sshape.len()));
                }
                if ishape.len() != sshape.len() {
                    return Err(RuntimeError::Backend(format!(
                        "step {i} (scatter_add): index rank {} differs from the source's {}",
                        ishape.len(),
                        sshape.len()
                    )));
                }
                let pad = 4 - sshape.len();
                let mut m = [1usize; 4];
                let mut ib = [1usize; 4];
                let mut q = [0usize; 4];
                let istrides = contiguous_strides(ishape);
                m[pad..].copy_from_slice(sshape);
                ib[pad..].copy_from_slice(ishape);
                q[pad..].copy_from_slice(&istrides);
                let (count, dim) = grid(units_for(total));
                let (src_buf, src_at) = self.operand(self.off(*src));
                let (index_buf, io) = self.operand(io);
                let (add_buf, add_at) = self.operand(self.off(*add));
                let (out_buf, out_at) = self.operand(self.off(*out));
                // SAFETY: every operand lies inside the arena; `out` is `src` or apart from
                // every operand.
                unsafe {
                    scatter_add_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        src_buf,
                        index_buf,
                        add_buf,
                        out_buf,
                        src_at,
                        io,
                        add_at,
                        out_at,
                        m[1],
                        m[2],
                        m[3],
                        ib[0],
                        ib[1],
                        ib[2],
                        ib[3],
                        q[0],
                        q[1],
                        q[2],
                        q[3],
                        (pad + axis) as u32,
                        total,
                    )
                };
            }
            Step::Iota { out, inner, dim } => {
                let n = g.ty(*out).numel();
                let values: Vec<f32> = (0..n).map(|i| iota_value(i, *inner, *dim)).collect();
                self.write_floats(self.off(*out), &values);
            }
            Step::Random {
                out,
                seed,
                stream,
                normal,
            } => {
                let n = g.ty(*out).numel();
                let seed = self.read_floats(self.off(*seed), 1)?[0];
                let values: Vec<f32> = (0..n)
                    .map(|i| random_value(seed, *stream, *normal, i))
                    .collect();
                self.write_floats(self.off(*out), &values);
            }
            Step::CollectiveStart {
                collective,
                mesh_dims,
                src,
                handle,
            } => {
                #[cfg(feature = "cuda")]
                if self.nccl.is_some() {
                    // The operand must be written before NCCL's stream reads it.
                    self.sync()?;
                    let (src_at, dst_at) = (self.off(*src), self.off(*handle));
                    let call = crate::comm::CollectiveCall::new(
                        g,
                        self.comm.rank(),
                        *collective,
                        mesh_dims,
                        (*src, std::ptr::null()),
                        (*handle, std::ptr::null_mut()),
                    )?;
                    if let Some(rank) = self.nccl.as_mut() {
                        // SAFETY: the planner keeps the operand and the handle's bytes for
                        // this collective until its wait; no launch touches them meanwhile.
                        unsafe { rank.world.start(&call, src_at, dst_at)? };
                    }
                    return Ok(());
                }
                // Reading the operand waits for the launches that produce it.
                let src_elems = g.ty(*src).numel();
                let mut staged = Staged {
                    src: self.read_floats(self.off(*src), src_elems)?,
                    dst: vec![0.0; g.ty(*handle).numel()],
                };
                let call = crate::comm::CollectiveCall::new(
                    g,
                    self.comm.rank(),
                    *collective,
                    mesh_dims,
                    (*src, staged.src.as_ptr()),
                    (*handle, staged.dst.as_mut_ptr()),
                )?;
                // SAFETY: both vectors are kept in `self.staged` until the wait, which drops
                // them only after `comm.wait` returned; nothing else reads or writes them.
                unsafe { self.comm.start(call)? };
                self.staged.insert(handle.index(), staged);
            }
            Step::Wait { handle, .. } => {
                #[cfg(feature = "cuda")]
                if let Some(rank) = self.nccl.as_mut() {
                    if let Some((at, len)) = rank.world.wait(handle.index())? {
                        self.round_to_bf16(at, len);
                    }
                    return Ok(());
                }
                self.comm.wait(handle.index())?;
                let staged = self.staged.remove(&handle.index()).ok_or_else(|| {
                    RuntimeError::Backend(format!(
                        "step {i} (wait): no collective was started on value {}",
                        handle.index()
                    ))
                })?;
                // The wait's result shares its handle's bytes (the buffer plan's rule).
                self.write_floats(self.off(*handle), &staged.dst);
            }
            Step::Offload { src, out } => {
                // The read waits for the launches that produce `src`; its bytes are free after.
                let data = self.read_floats(self.off(*src), g.ty(*src).numel())?;
                self.host.insert(*out, data);
            }
            Step::Reload { src, out } => {
                let data = self.host.get(src).ok_or_else(|| {
                    RuntimeError::Backend(format!(
                        "step {i} (reload): value {} was never offloaded",
                        src.index()
                    ))
                })?;
                self.write_floats(self.off(*out), data);
            }
            Step::Attention { .. }
            | Step::AttentionBackward { .. }
            | Step::Rope { .. }
            | Step::CrossEntropy { .. }
            | Step::CrossEntropyBackward { .. }
            | Step::AdamW { .. } => self.run_composite(i, step)?,
            other => {
                return Err(RuntimeError::Backend(format!(
                    "step {i} ({}) has no {} kernel: the lowering should have lowered it to \
map, copy or reduce launches",
                    other.kind(),
                    self.kind.name()
                )))
            }
        }
        Ok(())
    }

    /// A view's arena offset and its four strides (rank 4, as attention and rope take them).
    fn view4(&self, v: &View, what: &str) -> Result<(usize, [usize; 4]), RuntimeError> {
        let strides: [usize; 4] = v.strides.as_slice().try_into().map_err(|_| {
            RuntimeError::Backend(format!(
                "{what} must be a rank-4 view, got shape {:?}",
                v.shape
            ))
        })?;
        Ok((self.off(v.base) + v.offset, strides))
    }

    /// An output view of attention: rank 4 with contiguous rows, as the lowering makes them.
    fn out4(&self, v: &View, what: &str) -> Result<(usize, [usize; 4]), RuntimeError> {
        let (at, strides) = self.view4(v, what)?;
        if strides[3] != 1 {
            return Err(RuntimeError::Backend(format!(
                "{what} must have contiguous rows, got strides {strides:?}"
            )));
        }
        Ok((at, strides))
    }

    /// Cross-entropy's operands after the target check: logits offset, row and column
    /// strides, rows, classes; targets offset and stride.
    fn cross_entropy_operands(
        &self,
        i: usize,
        step: &Step,
        logits: &View,
        targets: &View,
    ) -> Result<CrossEntropyOperands, RuntimeError> {
        let (&[rows, cols], &[xr, xc], &[n], &[ts]) = (
            logits.shape.as_slice(),
            logits.strides.as_slice(),
            targets.shape.as_slice(),
            targets.strides.as_slice(),
        ) else {
            return Err(RuntimeError::Backend(format!(
                "cross-entropy needs [N, C] logits and [N] targets, got {:?} and {:?}",
                logits.shape, targets.shape
            )));
        };
        if n != rows || cols == 0 {
            return Err(RuntimeError::Backend(format!(
                "cross-entropy needs one target per row of non-empty logits, got {:?} logits \
and {n} targets",
                logits.shape
            )));
        }
        let t = self.off(targets.base) + targets.offset;
        if !self.checked_on_write.contains(&i) {
            self.check_indices(i, step, t, ts, rows, cols, TARGET)?;
        }
        Ok(CrossEntropyOperands {
            x: self.off(logits.base) + logits.offset,
            xr,
            xc,
            rows,
            cols,
            t,
            ts,
        })
    }

    /// Runs a composite step on `composites.rs`'s kernels.
    fn run_composite(&mut self, i: usize, step: &Step) -> Result<(), RuntimeError> {
        let scratch = self.tail.scratch;
        match step {
            Step::Rope { out, x, layout, .. } => {
                let [b, seq, heads, d] = match x.shape.as_slice() {
                    &[b, s, h, d] if d % 2 == 0 => [b, s, h, d],
                    other => {
                        return Err(RuntimeError::Backend(format!(
                            "rope needs a [B, S, H, D] input with D even, got {other:?}"
                        )))
                    }
                };
                let (xo, xs) = self.view4(x, "rope's input")?;
                let Some(&cos) = rope_key(step).and_then(|key| self.tail.rope.get(&key)) else {
                    return Err(RuntimeError::Backend(format!(
                        "step {i} (rope): no angle table was prepared for it at load"
                    )));
                };
                let half = d / 2;
                let total = b * seq * heads * half;
                if total == 0 {
                    return Ok(());
                }
                let (count, dim) = grid(units_for(total));
                let (x_buf, xo) = self.operand(xo);
                let (out_buf, out_at) = self.operand(self.off(*out));
                let (tables, cos) = self.operand(cos);
                // SAFETY: the view, the output and the tables lie inside their buffers, the
                // output apart from the input (the planner never places an output over a live
                // operand).
                unsafe {
                    rope_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        x_buf,
                        out_buf,
                        tables,
                        xo,
                        xs[0],
                        xs[1],
                        xs[2],
                        xs[3],
                        out_at,
                        cos,
                        cos + seq * half,
                        seq,
                        heads,
                        half,
                        u32::from(*layout == graphtrain_ir::RopeLayout::Interleaved),
                        total,
                    )
                };
            }
            Step::AdamW {
                updates,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                // The bias corrections, on the host: written at the start of the run where the
                // step count is an input the host wrote (so the launches below can be recorded
                // in a device graph), else here.
                if !self.corrections_at_start.contains(&i) {
                    self.write_corrections(i, step)?;
                }
                let corrections = self.tail.corrections[&i];
                for u in updates {
                    let n = self.program.graph.ty(u.p).numel();
                    if n == 0 {
                        continue;
                    }
                    let (count, dim) = grid(units_for(n));
                    let (p_buf, p) = self.operand(self.off(u.p));
                    let (g_buf, g) = self.operand(self.off(u.g));
                    let (m_buf, m) = self.operand(self.off(u.m));
                    let (v_buf, v) = self.operand(self.off(u.v));
                    let (p_out_buf, p_out) = self.operand(self.off(u.p_out));
                    let (m_out_buf, m_out) = self.operand(self.off(u.m_out));
                    let (v_out_buf, v_out) = self.operand(self.off(u.v_out));
                    let (lr_buf, lr) = self.operand(self.off(*lr));
                    let (corrections_buf, corrections) = self.operand(corrections);
                    // SAFETY: every value lies inside the arena; an output is its own input
                    // (in place, each element read before it is written by the same unit) or
                    // apart from every operand.
                    unsafe {
                        adamw_kernel::launch_unchecked(
                            &self.client,
                            count,
                            dim,
                            p_buf,
                            g_buf,
                            m_buf,
                            v_buf,
                            p_out_buf,
                            m_out_buf,
                            v_out_buf,
                            lr_buf,
                            corrections_buf,
                            p,
                            g,
                            m,
                            v,
                            p_out,
                            m_out,
                            v_out,
                            lr,
                            corrections,
                            *beta1 as f32,
                            (1.0 - beta1) as f32,
                            *beta2 as f32,
                            (1.0 - beta2) as f32,
                            *eps as f32,
                            (-weight_decay) as f32,
                            n,
                        )
                    };
                }
            }
            Step::CrossEntropy {
                out,
                logits,
                targets,
            } => {
                let x = self.cross_entropy_operands(i, step, logits, targets)?;
                let (count, dim) = grid(units_for(x.rows));
                let (x_buf, xo) = self.operand(x.x);
                let (targets_buf, to) = self.operand(x.t);
                let (stats_buf, stats) = self.operand(scratch);
                let (losses_buf, losses) = self.operand(scratch + 2 * x.rows);
                // SAFETY: the views and the scratch lie inside their buffers; the targets were
                // checked.
                unsafe {
                    cross_entropy_rows_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        x_buf,
                        targets_buf,
                        stats_buf,
                        losses_buf,
                        xo,
                        x.xr,
                        x.xc,
                        to,
                        x.ts,
                        stats,
                        losses,
                        1,
                        x.cols,
                        x.rows,
                    );
                    let (count, dim) = grid(1);
                    let (losses_buf, losses) = self.operand(scratch + 2 * x.rows);
                    let (out_buf, out_at) = self.operand(self.off(*out));
                    mean_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        losses_buf,
                        out_buf,
                        losses,
                        out_at,
                        x.rows,
                    )
                };
            }
            Step::CrossEntropyBackward {
                out,
                logits,
                targets,
                grad,
            } => {
                let x = self.cross_entropy_operands(i, step, logits, targets)?;
                let (count, dim) = grid(units_for(x.rows));
                let total = x.rows * x.cols;
                let operands = |this: &Self| {
                    let (x_buf, xo) = this.operand(x.x);
                    let (targets_buf, to) = this.operand(x.t);
                    let (stats_buf, stats) = this.operand(scratch);
                    (x_buf, xo, targets_buf, to, stats_buf, stats)
                };
                let (x_buf, xo, targets_buf, to, stats_buf, stats) = operands(self);
                // The losses' buffer: unused without them (`with_loss` 0).
                let (unused, _) = self.operand(scratch);
                // SAFETY: as for the forward step; the output is apart from every operand.
                unsafe {
                    cross_entropy_rows_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        x_buf,
                        targets_buf,
                        stats_buf,
                        unused,
                        xo,
                        x.xr,
                        x.xc,
                        to,
                        x.ts,
                        stats,
                        stats,
                        0,
                        x.cols,
                        x.rows,
                    );
                    let (count, dim) = grid(units_for(total));
                    let (x_buf, xo, targets_buf, to, stats_buf, stats) = operands(self);
                    let (grad_buf, grad_at) = self.operand(self.off(*grad));
                    let (out_buf, out_at) = self.operand(self.off(*out));
                    cross_entropy_backward_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        x_buf,
                        targets_buf,
                        stats_buf,
                        grad_buf,
                        out_buf,
                        xo,
                        x.xr,
                        x.xc,
                        to,
                        x.ts,
                        stats,
                        grad_at,
                        out_at,
                        x.cols,
                        total,
                    )
                };
            }
            Step::Attention {
                out,
                q,
                k,
                v,
                stats,
                causal,
                scale,
                bf16,
            } => {
                let d = attention_dims(q, k, *causal, *scale)?;
                let q4 = self.view4(q, "attention's queries")?;
                let k4 = self.view4(k, "attention's keys")?;
                let v4 = self.view4(v, "attention's values")?;
                let o4 = self.out4(out, "attention's output")?;
                let out_at = o4.0;
                let total = d.batch * d.heads * d.seq;
                if total == 0 || d.head_dim == 0 {
                    return Ok(());
                }
                let (count, dim) = grid(units_for(total));
                let (q_buf, q4) = self.heads4(q4);
                let (k_buf, k4) = self.heads4(k4);
                let (v_buf, v4) = self.heads4(v4);
                let (o_buf, o4) = self.heads4(o4);
                // Without statistics the kernel writes none: the output's buffer stands in.
                let (s_buf, s_at) = self.operand(stats.map_or(out_at, |s| self.off(s)));
                // SAFETY: the views and the outputs lie inside the arena, the outputs apart from
                // them and each other (the planner never places an output over a live operand).
                unsafe {
                    attention_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        q_buf,
                        k_buf,
                        v_buf,
                        o_buf,
                        s_buf,
                        q4,
                        k4,
                        v4,
                        o4,
                        s_at,
                        attention_shape(&d, *bf16),
                        total,
                        d.head_dim,
                        stats.is_some(),
                    )
                };
            }
            Step::AttentionBackward {
                dq,
                dk,
                dv,
                q,
                k,
                v,
                dout,
                stats: given,
                causal,
                scale,
                bf16,
            } => {
                let d = attention_dims(q, k, *causal, *scale)?;
                let q4 = self.view4(q, "attention's queries")?;
                let k4 = self.view4(k, "attention's keys")?;
                let v4 = self.view4(v, "attention's values")?;
                let g4 = self.view4(dout, "attention's output gradient")?;
                let dq4 = self.out4(dq, "the query gradient")?;
                let dk4 = self.out4(dk, "the key gradient")?;
                let dv4 = self.out4(dv, "the value gradient")?;
                let rows = d.batch * d.heads * d.seq;
                let key_rows = d.batch * d.kv_heads * d.seq;
                if rows == 0 || d.head_dim == 0 {
                    return Ok(());
                }
                // SAFETY: the views, the outputs and the scratch lie inside the buffer; the
                // three outputs are distinct and apart from the operands.
                unsafe {
                    let (count, dim) = grid(units_for(rows));
                    let (q_buf, q) = self.heads4(q4);
                    let (k_buf, k) = self.heads4(k4);
                    let (v_buf, v) = self.heads4(v4);
                    let (g_buf, g) = self.heads4(g4);
                    let (dq_buf, dq) = self.heads4(dq4);
                    let (stats_buf, stats) = self.operand(scratch);
                    // Without the forward's statistics the scratch stands in (never read).
                    let (f_buf, f_at) = self.operand(given.map_or(scratch, |s| self.off(s)));
                    attention_dq_kernel::launch_unchecked(
                        &self.client,
                        count,
                        dim,
                        q_buf,
                        k_buf,
                        v_buf,
                        g_buf,
                        dq_buf,
                        stats_buf,
                        f_buf,
                        q,
                        k,
                        v,
                        g,
                        dq,
                        stats,
                        f_at,
                        attention_shape(&d, *bf16),
                        rows,
                        d.head_dim,
                        given.is_some(),
                    );
                    // One launch per query head of a group, in order (see the kernel).
                    for member in 0..d.heads / d.kv_heads {
                        let (count, dim) = grid(units_for(key_rows));
                        let (q_buf, q) = self.heads4(q4);
                        let (k_buf, k) = self.heads4(k4);
                        let (v_buf, v) = self.heads4(v4);
                        let (g_buf, g) = self.heads4(g4);
                        let (dk_buf, dk) = self.heads4(dk4);
                        let (dv_buf, dv) = self.heads4(dv4);
                        let (stats_buf, stats) = self.operand(scratch);
                        attention_kv_backward_kernel::launch_unchecked(
                            &self.client,
                            count,
                            dim,
                            q_buf,
                            k_buf,
                            v_buf,
                            g_buf,
                            dk_buf,
                            dv_buf,
                            stats_buf,
                            q,
                            k,
                            v,
                            g,
                            dk,
                            dv,
                            stats,
                            attention_shape(&d, *bf16),
                            member,
                            key_rows,
                            d.head_dim,
                        )
                    }
                };
            }
            _ => unreachable!("not a composite step"),
        }
        Ok(())
    }
}

/// The attention kernels' shape for `d`.
fn attention_shape(d: &Dims, bf16: bool) -> AttentionShapeLaunch {
    AttentionShapeLaunch::new(
        d.heads,
        d.heads / d.kv_heads,
        d.seq,
        u32::from(d.causal),
        d.scale,
        u32::from(bf16),
    )
}

struct CrossEntropyOperands {
    x: usize,
    xr: usize,
    xc: usize,
    rows: usize,
    cols: usize,
    t: usize,
    ts: usize,
}

/// The key of a rope step's angle tables.
fn rope_key(step: &Step) -> Option<TableKey> {
    match step {
        Step::Rope {
            x, theta, inverse, ..
        } if x.shape.len() == 4 => Some(Tables::key(*theta, x.shape[1], x.shape[3], *inverse)),
        _ => None,
    }
}

/// The buffer past the Program's values and the index-check flag: each distinct rope step's
/// `[S, D/2]` cos and sin tables (cos at the offset, sin right after), then scratch that the
/// reductions of the composite steps share (each step's scratch is dead once it ends, and
/// steps run in order on one stream).
struct Tail {
    rope: HashMap<TableKey, usize>,
    /// Per AdamW step (by index), where its bias corrections `[1 - beta1^t, sqrt(1 - beta2^t)]`
    /// go: computed on the host, written before its launches read them.
    corrections: HashMap<usize, usize>,
    scratch: usize,
    /// Elements in the whole buffer.
    end: usize,
}

impl Tail {
    /// The tail of `program`'s buffer starting at element `start`, and the tables to write.
    fn plan(program: &Program, start: usize) -> (Tail, Vec<(TableKey, Tables)>) {
        let mut at = start;
        let mut rope = HashMap::new();
        let mut tables = Vec::new();
        let mut scratch = 0usize;
        let mut corrections = HashMap::new();
        for (i, step) in program.steps.iter().enumerate() {
            if let Step::AdamW { .. } = step {
                corrections.insert(i, at);
                at += VECTOR;
            }
            if let Some(key @ (theta, seq, d, inverse)) = rope_key(step) {
                if let std::collections::hash_map::Entry::Vacant(slot) = rope.entry(key) {
                    let t = Tables::new(f64::from_bits(theta), seq, d, inverse);
                    slot.insert(at);
                    at += (t.cos.len() + t.sin.len()).next_multiple_of(VECTOR);
                    tables.push((key, t));
                }
            }
            let need = match step {
                Step::CrossEntropy { logits, .. } => 3 * logits.shape.first().copied().unwrap_or(0),
                Step::CrossEntropyBackward { logits, .. } => {
                    2 * logits.shape.first().copied().unwrap_or(0)
                }
                // Three statistics per query row.
                Step::AttentionBackward { q, .. } => 3 * q.shape.iter().take(3).product::<usize>(),
                _ => 0,
            };
            scratch = scratch.max(need);
        }
        let tail = Tail {
            rope,
            corrections,
            scratch: at,
            end: at + scratch.next_multiple_of(VECTOR),
        };
        (tail, tables)
    }
}

/// The device's client. cubecl panics when a device it listed cannot be opened (an adapter
/// named by `CUBECL_WGPU_DEFAULT_DEVICE` that is not there, a driver that fails): its device
/// thread prints why, and its panic reaches this thread as a bare `RecvError`. That second
/// panic is caught and becomes an error; its message is kept off stderr (panics on other
/// threads still print).
fn open(device: &cubecl::Device, kind: DeviceKind) -> Result<Client, RuntimeError> {
    type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send>;
    let previous: std::sync::Arc<Hook> = std::sync::Arc::new(std::panic::take_hook());
    let here = std::thread::current().id();
    let forward = previous.clone();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().id() != here {
            forward(info)
        }
    }));
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| device.client()));
    std::panic::set_hook(Box::new(move |info| previous(info)));
    opened.map_err(|_| {
        RuntimeError::Unavailable(format!(
            "backend `{}` could not open its device (cubecl's reason is printed above). Or use \
--backend cpu.",
            kind.name()
        ))
    })
}

fn too_many_dims(step: &Step, rank: usize) -> RuntimeError {
    RuntimeError::Backend(format!(
        "{} over {rank} dims: the device kernels address at most 4",
        step.kind()
    ))
}

/// A gather's index dims padded to four (`n`), the source strides along them with the indexed
/// axis's zeroed (`s`), and that axis's stride.
fn padded_dims(
    ishape: &[usize],
    sshape: &[usize],
    axis: usize,
    step: &Step,
) -> Result<([usize; 4], [usize; 4], usize), RuntimeError> {
    if ishape.len() > 4 {
        return Err(too_many_dims(step, ishape.len()));
    }
    let pad = 4 - ishape.len();
    let sst = contiguous_strides(sshape);
    let mut n = [1usize; 4];
    let mut s = [0usize; 4];
    for d in 0..ishape.len() {
        n[pad + d] = ishape[d];
        s[pad + d] = if d == axis { 0 } else { sst[d] };
    }
    Ok((n, s, sst[axis]))
}

impl Executor for DeviceExecutor {
    fn graph(&self) -> &Graph {
        &self.program.graph
    }

    fn program(&self) -> Option<&Program> {
        Some(&self.program)
    }

    fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
        check_input(&self.program, v, t)?;
        if let Some(checks) = self.write_checks.get(&v) {
            index_checks::check(&self.program, checks, t)?;
        }
        let data: Vec<f32> = t.data.iter().map(|&x| x as f32).collect();
        // Only an input nothing replaces keeps the value the host wrote until the next write.
        let kept = graphs::written_by_host(&self.program, v);
        match data.as_slice() {
            [x] if kept => self.host_scalars.insert(v, *x),
            _ => self.host_scalars.remove(&v),
        };
        self.write_floats(self.off(v), &data);
        Ok(())
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError> {
        let ty = self.program.graph.ty(v).clone();
        let data = self.read_floats(self.off(v), ty.numel())?;
        HostTensor::new(ty, data.into_iter().map(f64::from).collect())
            .map_err(|e| RuntimeError::Backend(e.to_string()))
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let steps = std::mem::take(&mut self.program.steps);
        if let Some(r) = self.timeline.as_mut() {
            r.begin();
        }
        // Profiled and timed runs wait for every step; graphs replay on their own thread's
        // stream only.
        let thread = std::thread::current().id();
        let replays = self.profile.is_none()
            && self.timeline.is_none()
            && self.graph_thread.is_none_or(|t| t == thread);
        // AdamW's bias corrections for a step count the host wrote, before any launch (and any
        // replay) reads them.
        for &i in &self.corrections_at_start {
            if let Err(e) = self.write_corrections(i, &steps[i]) {
                self.program.steps = steps;
                return Err(e);
            }
        }
        let mut segments = std::mem::take(&mut self.segments);
        let mut next = 0;
        // Steps before this one have run already (a replayed or recorded segment).
        let mut ran_until = 0;
        let result = steps.iter().enumerate().try_for_each(|(i, step)| {
            if i < ran_until {
                return Ok(());
            }
            while next < segments.len() && segments[next].steps.end <= i {
                next += 1;
            }
            if let Some(segment) = segments.get_mut(next).filter(|_| replays) {
                if segment.steps.start == i && self.replay_or_record(segment, &steps)? {
                    self.graph_thread = Some(thread);
                    ran_until = segment.steps.end;
                    return Ok(());
                }
            }
            let started = Instant::now();
            self.run_step(i, step)?;
            if self.profile.is_some() || self.timeline.is_some() {
                self.sync()?;
            }
            if let Some(r) = self.timeline.as_mut() {
                r.record(i, timeline::KERNELS, started);
            }
            if let Some(p) = self.profile.as_mut().filter(|_| self.runs > 0) {
                let (key, flops) = profile_key(&self.program, step);
                match p.iter_mut().find(|e| e.0 == key) {
                    Some(e) => {
                        e.1 += started.elapsed();
                        e.2 += 1;
                    }
                    None => p.push((key, started.elapsed(), 1, flops)),
                }
            }
            Ok(())
        });
        self.program.steps = steps;
        self.segments = segments;
        if let Some(r) = self.timeline.as_mut() {
            r.finish(&self.program);
        }
        self.runs += 1;
        result?;
        self.sync()
    }

    fn profile_report(&mut self) -> Option<String> {
        Some(profile_report(self.profile.as_mut()?, 30))
    }

    fn device_graphs(&self) -> Option<(usize, usize)> {
        let recorded = self
            .segments
            .iter()
            .filter(|s| matches!(s.state, graphs::State::Recorded(_)));
        Some((
            recorded.clone().count(),
            recorded.map(|s| s.steps.len()).sum(),
        ))
    }

    fn record_timeline(&mut self, on: bool) -> bool {
        Recorder::switch(&mut self.timeline, on);
        true
    }

    fn take_timeline(&mut self) -> Option<Timeline> {
        self.timeline.as_mut()?.take()
    }

    fn memory_bytes(&self) -> usize {
        self.tail.end * 4
    }

    fn measured_memory(&self) -> Option<crate::MeasuredMemory> {
        Some(crate::MeasuredMemory {
            device_bytes: self.arena_measured,
            host_bytes: self.host.values().map(|v| (v.len() * 4) as u64).sum(),
        })
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// The kernel that rounds a bf16 sum NCCL made (run on `cuda` only) rounds as the host's
    /// `round_bf16` does, bit for bit, inside its range and nowhere else: checked on wgpu, the
    /// device the tests have.
    #[test]
    fn the_bf16_rounding_kernel_rounds_as_the_host_does() {
        let device = match DeviceKind::Wgpu.device() {
            Ok(d) => d,
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let client = open(&device, DeviceKind::Wgpu).unwrap();
        let values: Vec<f32> = (0..1000)
            .map(|i| match i % 7 {
                0 => f32::from_bits(0x3f80_8000), // a tie: rounds to even
                1 => f32::from_bits(0x3f81_8000), // a tie: rounds up to even
                2 => -1.0e-3 * i as f32,
                3 => f32::NAN,
                4 => 3.0e38,
                _ => (i as f32).sqrt() * 1.2345,
            })
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let buffer = client.create_from_slice(&bytes);
        let (at, len) = (10, 900);
        let (count, dim) = grid(units_for(len));
        // SAFETY: `at + len` is inside the buffer's 1000 floats.
        unsafe {
            kernels::round_bf16_kernel::launch_unchecked(
                &client,
                count,
                dim,
                BufferArg::from_raw_parts(buffer.clone(), values.len()),
                at,
                len,
            )
        };
        let read = client.read_one(buffer).unwrap();
        for (i, x) in values.iter().enumerate() {
            let got = f32::from_le_bytes([
                read[4 * i],
                read[4 * i + 1],
                read[4 * i + 2],
                read[4 * i + 3],
            ]);
            let want = if (at..at + len).contains(&i) {
                graphtrain_ir::host_tensor::round_bf16(*x)
            } else {
                *x
            };
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "element {i}: {x} became {got}, want {want}");
        }
    }
}
