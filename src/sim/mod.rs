//! `graphtrain sim`: predicts what one rank's compiled step does on a machine described by a
//! `Hardware` file, without running it.
//!
//! It reads the Program the step lowers to (the same steps, buffers and collectives a run
//! executes), and walks it in order on two lanes, as a rank runs it:
//! - the compute lane: each step costs a fixed launch plus the larger of its FLOPs at the
//!   peak of its precision times the efficiency of its kind (GEMM, attention) and its bytes at
//!   the memory bandwidth times the memory efficiency (a roofline per step);
//! - the communication lane: a collective's start queues it there (it begins when both the
//!   compute lane has reached the start and the lane is free); it takes the link's latency plus
//!   what one member sends under the ring algorithms (`graphtrain_ir::stats::comm_bytes`, as
//!   NCCL's rings) over the link's bandwidth; a wait
//!   blocks the compute lane until its collective ends, and that blocked time is the exposed
//!   communication.
//!
//! Memory is the buffer plan's arena (what the backend allocates), plus offloaded bytes on the
//! host. MFU counts the model's FLOPs per token (as `bench` does) against the peak of the
//! precision its matmuls use.
//!
//! Topology: ranks are laid out row-major over the mesh (the last dimension fastest), devices
//! fill nodes in rank order; a collective whose group spans more than one node runs at the
//! inter-node link, otherwise at the intra-node one. On a `Cpu` host, ranks share its cores and
//! memory bandwidth, so a rank computes at 1/world of the host's rates.
//!
//! What it does not model yet: contention between the communication lane and compute for
//! memory bandwidth, NCCL's tree algorithms (rings only), pipeline parallelism, the host's own
//! work between steps. The simulated run is a `Timeline`, written by `sim --trace-out` as the
//! same Chrome trace a recorded run gives (`run --trace-out`), so the two open side by side.

pub mod calibrate;
pub mod hardware;
pub mod objective;

pub use hardware::LinkSpec;

use graphtrain_ir::stats::comm_bytes;
use graphtrain_ir::{DType, Graph, Mesh, ValueId};
use graphtrain_lowering::program::Access;
use graphtrain_lowering::{FusionLimits, Mode, Program, Step};
use graphtrain_passes::Pipeline;
use graphtrain_runtime::timeline::{COMMUNICATION, KERNELS};
use graphtrain_runtime::{lower_for_backend, Backend};
use hardware::{Hardware, Kind};
use std::collections::HashMap;
use std::time::Duration;

/// The Program `graph` runs as on `hw`, through `pipeline`: what `runtime::compile` lowers
/// (legalized, fused, default limits), with offloading kept on a GPU (which has host memory to
/// move to) and removed on a cpu host, as compile does there. No device is needed.
pub fn lower_for(graph: &Graph, pipeline: &Pipeline, hw: &Hardware) -> Result<Program, String> {
    let (mut optimized, _) = pipeline.run(graph).map_err(|e| e.to_string())?;
    if hw.kind == Kind::Cpu {
        if let Some((kept, _)) = graphtrain_passes::offload::without_offloading(&optimized) {
            optimized = kept;
        }
    }
    // Every backend keeps the same composites, so the cpu's Program is the devices'.
    lower_for_backend(
        &optimized,
        Backend::Cpu,
        Mode::Fused,
        &FusionLimits::default(),
    )
    .map_err(|e| e.to_string())
}

/// Where the simulator says a rank's step time goes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prediction {
    /// One rank's step, seconds.
    pub step_s: f64,
    /// Compute-lane busy time by kind of work (`matmul`, `attention`, `memory`, `launch`,
    /// `host`), seconds.
    pub by_kind: Vec<(String, f64)>,
    /// Time the compute lane waited for collectives (exposed communication).
    pub exposed_comm_s: f64,
    /// Time the communication lane was busy.
    pub comm_s: f64,
    pub steps: usize,
    pub collectives: usize,
    /// The arena (device memory for tensors) and the host memory holding offloaded values.
    pub arena_bytes: usize,
    pub host_bytes: usize,
    /// The simulated run as a timeline: compute steps on lane `KERNELS`, collectives on
    /// `COMMUNICATION` (what `run --trace-out` records), for `sim --trace-out`.
    pub timeline: graphtrain_runtime::Timeline,
}

impl Prediction {
    fn add(&mut self, kind: &str, s: f64) {
        match self.by_kind.iter_mut().find(|(k, _)| k == kind) {
            Some(e) => e.1 += s,
            None => self.by_kind.push((kind.to_string(), s)),
        }
    }
}

/// How a simulated rank reaches the others: the hardware's links, or one link for every mesh
/// dimension (`--link`, as the emulated links of a threads run).
#[derive(Clone, Copy, Debug)]
pub enum Links {
    Hardware,
    Every(LinkSpec),
}

/// Simulates `program` (one rank's) on `hw`. `mesh` is the graph's, `nodes` how many nodes
/// the run spans (the mesh must fit in them).
pub fn simulate(
    program: &Program,
    hw: &Hardware,
    links: Links,
    nodes: usize,
) -> Result<Prediction, String> {
    let g = &program.graph;
    let world = g.mesh.as_ref().map_or(1, Mesh::world_size);
    hw.check_fits(world, nodes)
        .map_err(|e| format!("the mesh has {e} or a smaller mesh"))?;
    let rates = Rates::new(hw, links, world);
    let bandwidth = rates.bandwidth();
    let flop_rate = |dtype: DType, efficiency: f64| rates.flop_rate(dtype, efficiency);
    // What each value's buffer holds: 4 bytes an element, 2 for bf16 values stored so.
    let bytes = |v: ValueId| program.value_bytes(v) as f64;
    let launch = hw.launch_us * 1e-6;

    let mut p = Prediction {
        steps: program.steps.len(),
        arena_bytes: program.plan.arena_bytes,
        host_bytes: program.host_bytes(),
        ..Prediction::default()
    };
    let (mut compute, mut comm_free) = (0.0f64, 0.0f64);
    let mut ends: HashMap<ValueId, f64> = HashMap::new();
    let mut events: Vec<(usize, u32, Duration, Duration)> = Vec::new();
    let at = Duration::from_secs_f64;
    for (i, step) in program.steps.iter().enumerate() {
        let (kind, seconds) = match step {
            Step::Matmul {
                a,
                b,
                batch,
                m,
                n,
                k,
                bf16,
                ..
            } => {
                let flops = 2.0 * (batch * m * n * k) as f64;
                let shared_b = b.strides.first() == Some(&0);
                let b_elems = if shared_b { k * n } else { batch * k * n };
                let moved = 4.0 * (batch * (m * k + m * n) + b_elems) as f64;
                // The products' precision is the operands', not the result's: a bf16 product
                // written through its widening cast (a weight gradient of bf16-mixed) is an f32
                // value in the graph, and an f32 operand whose cast fusion folded into the
                // product is read as bf16 (`bf16.a`, `bf16.b`).
                let bf16_products = bf16.a
                    || bf16.b
                    || [a.base, b.base]
                        .iter()
                        .any(|v| g.ty(*v).dtype == DType::BF16);
                let dtype = if bf16_products {
                    DType::BF16
                } else {
                    DType::F32
                };
                let t = (flops / flop_rate(dtype, hw.efficiency.matmul)).max(moved / bandwidth);
                ("matmul", t)
            }
            Step::Attention {
                q, causal, bf16, ..
            }
            | Step::AttentionBackward {
                q, causal, bf16, ..
            } => {
                let [b, h, s, d] = dims4(&q.shape);
                let mut flops = 4.0 * (b * h * s * s * d) as f64;
                if *causal {
                    flops /= 2.0;
                }
                // Backward recomputes the probabilities and does four products: 2.5x forward.
                if matches!(step, Step::AttentionBackward { .. }) {
                    flops *= 2.5;
                }
                // bf16 attention (bf16-mixed's) runs its products at the bf16 rate.
                let t = if *bf16 {
                    let efficiency = hw.efficiency.attention_bf16;
                    flops / flop_rate(DType::BF16, efficiency.unwrap_or(hw.efficiency.attention))
                } else {
                    flops / flop_rate(DType::F32, hw.efficiency.attention)
                };
                ("attention", t)
            }
            Step::CollectiveStart {
                collective,
                mesh_dims,
                src,
                handle,
            } => {
                let mesh = g
                    .mesh
                    .as_ref()
                    .ok_or("a collective in a graph without a mesh")?;
                let seconds = rates.collective_seconds(*collective, mesh, mesh_dims, bytes(*src));
                let begin = compute.max(comm_free);
                comm_free = begin + seconds;
                events.push((i, COMMUNICATION, at(begin), at(seconds)));
                p.comm_s += seconds;
                p.collectives += 1;
                ends.insert(*handle, comm_free);
                ("launch", 0.0)
            }
            Step::Wait { handle, .. } => {
                let end = ends.get(handle).copied().unwrap_or(compute);
                let blocked = (end - compute).max(0.0);
                p.exposed_comm_s += blocked;
                events.push((i, KERNELS, at(compute), at(blocked)));
                compute += blocked;
                continue;
            }
            Step::Offload { src, .. } | Step::Reload { src, .. } => {
                let t = match hw.kind {
                    Kind::Gpu => hw.host_link.seconds(bytes(*src)),
                    Kind::Cpu => 2.0 * bytes(*src) / bandwidth,
                };
                ("host", t)
            }
            other => ("memory", moved_bytes(g, other) / bandwidth),
        };
        p.add(kind, seconds);
        p.add("launch", launch);
        if !matches!(step, Step::CollectiveStart { .. }) {
            events.push((i, KERNELS, at(compute), at(seconds + launch)));
        }
        compute += seconds + launch;
    }
    // The step ends when both lanes are done (a collective nobody waits for still runs).
    p.step_s = compute.max(comm_free);
    p.timeline = graphtrain_runtime::Timeline::of_steps(program, events, at(p.step_s));
    Ok(p)
}

/// The rates one rank works at on `hw`: ranks of a cpu host share its cores and memory
/// bandwidth; a collective runs on the link `link_for` picks for its group.
pub struct Rates<'a> {
    hw: &'a Hardware,
    links: Links,
    /// Ranks sharing one device's compute and memory (the world on a cpu host, else 1).
    share: f64,
}

impl<'a> Rates<'a> {
    pub fn new(hw: &'a Hardware, links: Links, world: usize) -> Rates<'a> {
        let share = match hw.kind {
            Kind::Cpu => world as f64,
            Kind::Gpu => 1.0,
        };
        Rates { hw, links, share }
    }

    pub fn hardware(&self) -> &'a Hardware {
        self.hw
    }

    /// Bytes a second of memory-bound work.
    pub fn bandwidth(&self) -> f64 {
        self.hw.memory_gbps * 1e9 * self.hw.efficiency.memory / self.share
    }

    /// FLOP a second at the peak of `dtype` times `efficiency`.
    pub fn flop_rate(&self, dtype: DType, efficiency: f64) -> f64 {
        let peak = match dtype {
            DType::BF16 => self.hw.peak_gflops_bf16,
            _ => self.hw.peak_gflops_f32,
        };
        peak * 1e9 * efficiency / self.share
    }

    /// Seconds of memory-bound work moving `bytes`.
    pub fn memory_seconds(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth()
    }

    /// Seconds of `collective` on an operand of `bytes` over `dims` of `mesh`, as rank 0's
    /// group runs it.
    pub fn collective_seconds(
        &self,
        collective: graphtrain_ir::op::Collective,
        mesh: &Mesh,
        dims: &[usize],
        bytes: f64,
    ) -> f64 {
        let group = mesh.group(0, dims);
        if group.len() <= 1 {
            return 0.0;
        }
        let sent = comm_bytes(collective, group.len(), bytes as usize);
        link_for(self.hw, self.links, &group).seconds(sent)
    }
}

/// The link a collective over `group` (ranks, row-major over the mesh) runs at: the emulated
/// one, or on a GPU cluster the inter-node link when the group spans nodes, else the intra-node
/// one.
pub fn link_for(hw: &Hardware, links: Links, group: &[usize]) -> LinkSpec {
    match links {
        Links::Every(l) => l,
        Links::Hardware => {
            let first = group[0] / hw.gpus_per_node;
            if hw.kind == Kind::Gpu && group.iter().any(|r| r / hw.gpus_per_node != first) {
                hw.inter_node
            } else {
                hw.intra_node
            }
        }
    }
}

fn dims4(shape: &[usize]) -> [usize; 4] {
    let mut d = [1usize; 4];
    let r = shape.len().min(4);
    d[4 - r..].copy_from_slice(&shape[shape.len() - r..]);
    d
}

/// Bytes a memory-bound step reads and writes.
fn moved_bytes(g: &Graph, step: &Step) -> f64 {
    let numel = |v: ValueId| g.ty(v).numel();
    let elems: usize = match step {
        Step::Map { len, inputs, .. } => {
            len + inputs
                .iter()
                .map(|i| match i.access {
                    Access::Full => *len,
                    Access::Scalar => 1,
                    Access::Outer { .. } | Access::Inner { .. } => numel(i.value).min(*len),
                })
                .sum::<usize>()
        }
        Step::MapReduce {
            outer,
            inner,
            inputs,
            out,
            ..
        } => numel(*out) + inputs.len() * outer * inner,
        Step::Copy { src, .. } => 2 * src.shape.iter().product::<usize>(),
        Step::Reduce { src, out, .. } => numel(*out) + src.shape.iter().product::<usize>(),
        Step::Gather { out, index, .. } => 2 * numel(*out) + numel(*index),
        Step::ScatterAdd { src, add, .. } => 2 * numel(*src) + numel(*add),
        Step::AdamW { updates, .. } => updates.iter().map(|u| 7 * numel(u.p)).sum(),
        Step::CrossEntropy { logits, .. } => 2 * logits.shape.iter().product::<usize>(),
        Step::CrossEntropyBackward { logits, .. } => 3 * logits.shape.iter().product::<usize>(),
        Step::Rope { out, .. } => 2 * numel(*out),
        other => other.outputs().into_iter().map(numel).sum(),
    };
    (elems * 4) as f64
}
