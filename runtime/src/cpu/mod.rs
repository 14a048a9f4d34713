//! The `cpu` backend: a Program run on cubecl-cpu. One arena buffer holds every value; map,
//! copy and reduce steps are cubecl kernels (`shared/kernels.rs`) JIT-compiled through MLIR/LLVM;
//! matmuls run our own GEMM (`gemm.rs`), attention and rope our own host kernels
//! (`attention.rs`, `rope.rs`), and gather / scatter-add / iota / random run on the host, all on
//! the arena's host memory, which cubecl-cpu lets us address directly.
//!
//! Why the GEMM is native: cubek-matmul's CpuGemm reached 16-26 GFLOP/s at 1024^3 here against a
//! 333 GFLOP/s peak (docs/cubecl-notes.md); a packed, register-tiled GEMM on the same host
//! buffers reaches most of the peak, and it is deterministic (fixed summation order, any thread
//! count).
//!
//! Ordering: a kernel step inside a capture region runs its bound launches synchronously
//! (`replay.rs`); one outside every region is dispatched through cubecl and queues on its
//! server. Any step that runs here first waits for that queue (`sync`, free when nothing is
//! queued), so every step sees its predecessors' writes.

pub mod adamw;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_amx;
pub mod bf16_pack;
pub mod cross_entropy;
pub mod gemm;
pub mod gemm_amx;
pub mod gemm_bf16;
pub mod lines;
pub mod pool;
pub mod replay;
pub mod rope;
mod rows;

use crate::options::{Profile, RuntimeOptions};
use crate::shared::attention_shape::attention_dims;
use crate::shared::kernel_call::Binding;
use crate::shared::launches::{Grid, Launches};
use crate::shared::profile::{profile_key, profile_report, ProfileEntry};
use crate::shared::rope_tables::{TableKey, Tables};
use crate::shared::{check_input, iota_value, random_value};
use crate::timeline::{self, Recorder, Timeline};
use crate::{Communicator, Executor, RuntimeError};
use cubecl::cpu::compute::server::CpuServer;
use cubecl::prelude::*;
use gemm::Layout;
use graphtrain_ir::{Graph, HostTensor, ValueId};
use graphtrain_lowering::program::contiguous_strides;
use graphtrain_lowering::{Bf16Rounding, Program, Step, View};
use pool::Pool;
use replay::{BoundLaunch, KernelCache};
use std::time::{Duration, Instant};

/// Widest vector the map kernels use (8 f32 = one AVX2 register).
const VECTOR: usize = graphtrain_lowering::program::BROADCAST_ALIGN;
/// Units per launch and GEMM threads: the pool's width (one per core), so the work split
/// matches the threads that run it.
fn units() -> u32 {
    Pool::current().width() as u32
}

/// Launches below `small` outputs stay on one thread: waking the pool costs more than they do.
const GRID: Grid = Grid {
    vector: VECTOR,
    map_vector: VECTOR,
    units: |work, small| if work >= small { units() } else { 1 },
    guard_ops: false,
};

pub struct CpuExecutor {
    program: Program,
    client: ComputeClient,
    arena: cubecl::server::Handle,
    /// Keeps the arena's host memory in place while we hold its pointer.
    _resource: Box<dyn std::any::Any>,
    base: *mut f32,
    len: usize,
    /// Compiled kernels of the bound launches.
    cache: KernelCache,
    /// Per step of a captured region, its launches bound to the arena (on its first run).
    bound: Vec<Option<Vec<BoundLaunch>>>,
    /// Whether launches dispatched through cubecl may still be queued.
    queued: bool,
    /// Rotary angle tables by (theta bits, sequence, head dim, inverse), built on first use.
    rope_tables: std::collections::HashMap<TableKey, Tables>,
    /// Time spent in the first run (kernel JIT included).
    pub first_run: Option<Duration>,
    /// When set, every step is waited for and timed by kind (`Profile::ByKind`): slower,
    /// for finding where the time goes.
    profile: Option<Vec<ProfileEntry>>,
    /// `Profile::EachStep`: every step other than a matmul is its own profile entry, with its
    /// index and what it does.
    profile_each_step: bool,
    /// Present while timeline recording is on: one `Option` test per step otherwise.
    timeline: Option<Recorder>,
    /// The GEMM kernel matmuls and attention's products run on.
    gemm: gemm::GemmKernel,
    /// The lanes of plain map kernels (`RuntimeOptions::map_vector`).
    map_vector: usize,
    comm: Box<dyn Communicator>,
    /// Offloaded values (`Program::host_values`), from their offload to the next run's.
    /// Compiled for `cpu`, a Program has none (`compile` removes offloading there: the arena is
    /// already host memory); one lowered elsewhere runs all the same.
    host: std::collections::HashMap<ValueId, Vec<f32>>,
}

type ComputeClient = Client;

impl CpuExecutor {
    pub fn new(
        program: Program,
        options: RuntimeOptions,
        comm: Box<dyn Communicator>,
    ) -> Result<Self, RuntimeError> {
        let device = cubecl::Device::cpu().map_err(|e| {
            RuntimeError::Unavailable(format!("the cpu backend could not start: {e}"))
        })?;
        let client = device.client();
        // At least one element so an empty program still has a buffer to bind.
        let len = program.arena_elems().max(VECTOR);
        if len > u32::MAX as usize {
            return Err(RuntimeError::DoesNotFit(format!(
                "the program does not fit: the buffer plan needs {} ({}), beyond the 2^32 \
elements (16 GiB) the cpu kernels address",
                crate::mib(len * 4),
                program.plan
            )));
        }
        if let Some(available) = options.available_memory_bytes() {
            if len * 4 > available {
                return Err(RuntimeError::DoesNotFit(format!(
                    "the program does not fit: the buffer plan needs {} ({}), and {} of host \
memory is available to the cpu backend",
                    crate::mib(len * 4),
                    program.plan,
                    crate::mib(available)
                )));
            }
        }
        let arena = client.empty(len * 4);
        let resource = client
            .get_resource::<CpuServer>(arena.clone())
            .map_err(|e| RuntimeError::Backend(format!("cannot map the arena: {e:?}")))?;
        let (ptr, bytes) = resource.resource().get_write_ptr_and_length();
        if bytes < len * 4 || !(ptr as usize).is_multiple_of(64) {
            return Err(RuntimeError::Backend(format!(
                "the arena came back with {bytes} bytes at alignment {}, need {} bytes aligned to 64",
                1usize << (ptr as usize).trailing_zeros().min(12),
                len * 4
            )));
        }
        back_with_huge_pages(ptr, bytes);
        let constants = program.constants.clone();
        let steps = program.steps.len();
        let mut exec = CpuExecutor {
            program,
            client,
            arena,
            _resource: Box::new(resource),
            base: ptr as *mut f32,
            len,
            cache: KernelCache::default(),
            bound: vec![None; steps],
            queued: false,
            rope_tables: Default::default(),
            first_run: None,
            profile: (options.profile != Profile::Off).then(Vec::new),
            profile_each_step: options.profile == Profile::EachStep,
            timeline: options.timeline.then(Recorder::default),
            gemm: options.gemm_kernel,
            map_vector: options.map_vector.lanes().map_err(RuntimeError::Backend)?,
            comm,
            host: Default::default(),
        };
        for (v, t) in &constants {
            exec.write(*v, t)?;
        }
        Ok(exec)
    }

    /// Waits for the launches dispatched through cubecl, if any are queued.
    fn sync(&mut self) -> Result<(), RuntimeError> {
        if !self.queued {
            return Ok(());
        }
        self.queued = false;
        cubecl::future::block_on(self.client.sync())
            .map_err(|e| RuntimeError::Backend(format!("a kernel failed: {e:?}")))
    }

    fn arena_mut(&mut self) -> &mut [f32] {
        // SAFETY: the pointer covers `len` f32 and stays valid while `_resource` lives; callers
        // sync first, so no kernel is writing meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    /// A rank-4 view as the attention kernels address it.
    fn heads(&self, v: &View) -> attention::Heads {
        let mut strides = [0; 4];
        strides.copy_from_slice(&v.strides);
        attention::Heads {
            offset: self.off(v.base) + v.offset,
            strides,
        }
    }

    /// An attention output view: rank 4 with contiguous rows, as the lowering makes them.
    fn output_heads(&self, v: &View) -> Result<attention::Heads, RuntimeError> {
        if v.strides.len() != 4 || v.strides[3] != 1 {
            return Err(RuntimeError::Backend(format!(
                "an attention output must be a [B, H, S, D] view with contiguous rows, got \
shape {:?} strides {:?}",
                v.shape, v.strides
            )));
        }
        Ok(self.heads(v))
    }

    /// The logits of a cross-entropy step and its checked targets.
    fn cross_entropy_operands(
        &self,
        logits: &View,
        targets: &View,
    ) -> Result<(cross_entropy::Logits, Vec<usize>), RuntimeError> {
        let (&[rows, cols], &[row_stride, col_stride], &[n], &[t_stride]) = (
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
        let halves = self.program.is_two_byte(logits.base);
        let slot = self.off(logits.base);
        let x = cross_entropy::Logits {
            // In halves where the logits are stored in 2 bytes: the view counts halves.
            offset: if halves { 2 * slot } else { slot } + logits.offset,
            rows,
            cols,
            row_stride,
            col_stride,
            halves,
        };
        let t_off = self.off(targets.base) + targets.offset;
        // SAFETY: the targets view lies in the arena.
        let t = unsafe { cross_entropy::targets(self.base, t_off, t_stride, n.min(rows), cols) }
            .map_err(RuntimeError::Input)?;
        Ok((x, t))
    }

    fn launches(&self) -> Launches<'_> {
        Launches {
            program: &self.program,
            grid: Grid {
                map_vector: self.map_vector,
                ..GRID
            },
        }
    }

    fn off(&self, v: ValueId) -> usize {
        self.program.elem_offset(v)
    }

    fn numel(&self, v: ValueId) -> usize {
        self.program.graph.ty(v).numel()
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &mut self,
        out: ValueId,
        a: &View,
        b: &View,
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        rounding: Bf16Rounding,
    ) -> Result<(), RuntimeError> {
        self.sync()?;
        let layout = |v: &View| Layout {
            batch_stride: v.strides[0],
            row_stride: v.strides[1],
            col_stride: v.strides[2],
        };
        // Each operand in f32 slots, or stored as bf16 in 2 bytes (`Program::is_two_byte`:
        // the view's offset and strides count halves from the value's first).
        let operand = |v: &View| -> Operand {
            let slot = self.off(v.base);
            // SAFETY: the view lies inside the arena, in its value's buffer.
            unsafe {
                if self.program.is_two_byte(v.base) {
                    Operand::Halves((self.base as *const u16).add(2 * slot + v.offset))
                } else {
                    Operand::F32(self.base.add(slot + v.offset))
                }
            }
        };
        let (sa, sb) = (operand(a), operand(b));
        let co = self.off(out);
        let c = if self.program.is_two_byte(out) {
            // SAFETY: C's buffer lies inside the arena.
            gemm_bf16::COut::Halves(unsafe { (self.base as *mut u16).add(2 * co) })
        } else {
            // SAFETY: as above.
            gemm_bf16::COut::F32(unsafe { self.base.add(co) })
        };
        let bf16 = rounding.out;
        let (la, lb, threads) = (layout(a), layout(b), units() as usize);
        // SAFETY (for the GEMMs below): the views and the output lie inside the arena; the
        // planner never places an output over a live operand.
        if let Some(tiles) = self.bf16_tiles().filter(|_| bf16) {
            // `widest` picks AMX only where it is available. Its packing rounds every f32
            // operand to bf16, its stores round C (the bf16 product's sums rounded once, as the
            // interpreter rounds them).
            unsafe {
                gemm_bf16::gemm_bf16_to(
                    tiles,
                    (batch, m, n, k),
                    (sa, la),
                    (sb, lb),
                    c,
                    threads,
                    true,
                )
            };
            return Ok(());
        }
        // The f32 GEMM reads f32 operands as they are: f32 operands of a bf16 product (a cast
        // fusion folded into it) are rounded into a copy first, and operands stored in 2 bytes
        // widened into one.
        // SAFETY: the views lie inside the arena (as above).
        let copy = |src: Operand, l: Layout, round: bool, rows: usize, cols: usize| unsafe {
            let copied = matches!(src, Operand::Halves(_)) || (bf16 && round);
            copied.then(|| rounded_copy(src, l, batch, rows, cols))
        };
        let (a_copy, b_copy) = (
            copy(sa, la, rounding.a, m, k),
            copy(sb, lb, rounding.b, k, n),
        );
        let in_place = |src: Operand, l: Layout| match src {
            Operand::F32(p) => (p, l),
            Operand::Halves(_) => unreachable!("an operand in halves is always copied"),
        };
        let (pa, la) = a_copy
            .as_ref()
            .map_or_else(|| in_place(sa, la), |(c, l)| (c.as_ptr(), *l));
        let (pb, lb) = b_copy
            .as_ref()
            .map_or_else(|| in_place(sb, lb), |(c, l)| (c.as_ptr(), *l));
        match c {
            gemm_bf16::COut::F32(pc) => {
                // SAFETY: as above; the copies hold what their layouts name.
                unsafe { gemm::sgemm_with(self.gemm, batch, m, n, k, pa, la, pb, lb, pc, threads) };
                if bf16 {
                    // A bf16 product: its f32 sums rounded once to bf16, as the interpreter
                    // rounds it.
                    // SAFETY: the output's `batch * m * n` elements lie inside the arena.
                    let c = unsafe { std::slice::from_raw_parts_mut(pc, batch * m * n) };
                    bf16_pack::round_in_place(c);
                }
            }
            gemm_bf16::COut::Halves(pc) => {
                // The f32 GEMM stores f32: into scratch, then halved (rounded) into C.
                let mut sums = vec![0f32; batch * m * n];
                // SAFETY: as above; `sums` holds C's elements, C's halves its buffer.
                unsafe {
                    gemm::sgemm_with(
                        self.gemm,
                        batch,
                        m,
                        n,
                        k,
                        pa,
                        la,
                        pb,
                        lb,
                        sums.as_mut_ptr(),
                        threads,
                    );
                    bf16_pack::copy_rows_to_halves(sums.as_ptr(), 0, pc, 0, (1, sums.len()));
                }
            }
        }
        Ok(())
    }

    /// The tiles bf16 products run on under the chosen GEMM, if the cpu has any (`None`: the
    /// f32 GEMM over bf16 values).
    fn bf16_tiles(&self) -> Option<gemm_bf16::Bf16Tiles> {
        let tiles = match self.gemm {
            gemm::GemmKernel::Widest => Some(gemm_bf16::Bf16Tiles::widest()),
            gemm::GemmKernel::Avx512 => Some(gemm_bf16::Bf16Tiles::Vdpbf16ps),
            _ => None,
        };
        tiles.filter(|_| gemm_bf16::available())
    }

    /// How an attention step's products run.
    fn attention_products(&self, bf16: bool) -> attention::Products {
        if bf16 {
            attention::Products::Bf16 {
                tiles: self.bf16_tiles(),
                kernel: self.gemm,
            }
        } else {
            attention::Products::F32(self.gemm)
        }
    }

    fn host_step(&mut self, step: &Step) -> Result<(), RuntimeError> {
        self.sync()?;
        let g = &self.program.graph;
        match step {
            Step::Gather {
                out,
                src,
                index,
                axis,
            } => {
                let sshape = &g.ty(*src).shape;
                let ishape = &g.ty(*index).shape;
                let (bound, stride) = (sshape[*axis], contiguous_strides(sshape)[*axis]);
                // SAFETY: every value lies inside the arena, and the planner never places a
                // step's output over one of its operands, so `out` overlaps neither input.
                let (src, index, out) = unsafe {
                    (
                        std::slice::from_raw_parts(
                            self.base.add(self.off(*src)),
                            g.ty(*src).numel(),
                        ),
                        std::slice::from_raw_parts(
                            self.base.add(self.off(*index)),
                            ishape.iter().product(),
                        ),
                        std::slice::from_raw_parts_mut(
                            self.base.add(self.off(*out)),
                            ishape.iter().product(),
                        ),
                    )
                };
                for_each_row(ishape, sshape, *axis, |row| {
                    let (idx, out) = (
                        &index[row.pos..row.pos + row.len],
                        &mut out[row.pos..row.pos + row.len],
                    );
                    match row.same_index(idx, bound)? {
                        // One source row for the whole output row (an embedding lookup).
                        Some(i) if row.step == 1 => {
                            let s = row.base + i * stride;
                            out.copy_from_slice(&src[s..s + row.len]);
                        }
                        _ => {
                            for (j, (o, &x)) in out.iter_mut().zip(idx).enumerate() {
                                let i = check_index(x, bound, row.pos + j)?;
                                *o = src[row.base + j * row.step + i * stride];
                            }
                        }
                    }
                    Ok(())
                })?;
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
                let (bound, stride) = (sshape[*axis], contiguous_strides(sshape)[*axis]);
                let (so, oo, n) = (self.off(*src), self.off(*out), g.ty(*src).numel());
                // `out` may take `src`'s place (an in-place update); `copy` handles the overlap.
                // SAFETY: both ranges lie inside the arena.
                unsafe { std::ptr::copy(self.base.add(so), self.base.add(oo), n) };
                // SAFETY: inside the arena; `out` overlaps neither `index` nor `add` (the
                // planner never places an output over an operand it still reads).
                let (index, add, out) = unsafe {
                    (
                        std::slice::from_raw_parts(
                            self.base.add(self.off(*index)),
                            ishape.iter().product(),
                        ),
                        std::slice::from_raw_parts(
                            self.base.add(self.off(*add)),
                            ishape.iter().product(),
                        ),
                        std::slice::from_raw_parts_mut(self.base.add(oo), n),
                    )
                };
                // Every output element receives its additions in position order, row path or
                // not, so the bits match the element-by-element definition.
                for_each_row(ishape, sshape, *axis, |row| {
                    let (idx, add) = (
                        &index[row.pos..row.pos + row.len],
                        &add[row.pos..row.pos + row.len],
                    );
                    match row.same_index(idx, bound)? {
                        Some(i) if row.step == 1 => {
                            let d = row.base + i * stride;
                            for (o, &a) in out[d..d + row.len].iter_mut().zip(add) {
                                *o += a;
                            }
                        }
                        _ => {
                            for (j, (&x, &a)) in idx.iter().zip(add).enumerate() {
                                let i = check_index(x, bound, row.pos + j)?;
                                out[row.base + j * row.step + i * stride] += a;
                            }
                        }
                    }
                    Ok(())
                })?;
            }
            Step::Iota { out, inner, dim } => {
                let (oo, n) = (self.off(*out), self.numel(*out));
                let (inner, dim) = (*inner, *dim);
                let arena = self.arena_mut();
                for i in 0..n {
                    arena[oo + i] = iota_value(i, inner, dim);
                }
            }
            Step::Random {
                out,
                seed,
                stream,
                normal,
            } => {
                let (oo, n, so) = (self.off(*out), self.numel(*out), self.off(*seed));
                let (stream, normal) = (*stream, *normal);
                let arena = self.arena_mut();
                let seed = arena[so];
                for i in 0..n {
                    arena[oo + i] = random_value(seed, stream, normal, i);
                }
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
                let (q, k, v) = (self.heads(q), self.heads(k), self.heads(v));
                let out = self.output_heads(out)?;
                let products = self.attention_products(*bf16);
                let stats = stats.map(|s| attention::Stats(self.off(s)));
                // SAFETY: the views and the outputs lie in the arena, the outputs apart from
                // them and each other (the planner never places an output over a live
                // operand); `products` names tiles only where the cpu has them.
                unsafe {
                    attention::forward(
                        self.base,
                        d,
                        products,
                        attention::Qkv { q, k, v },
                        out,
                        stats,
                    )
                };
            }
            Step::AdamW {
                updates,
                lr,
                step,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let (lr, t) = (self.off(*lr), self.off(*step));
                let (lr, t) = (self.arena_mut()[lr], self.arena_mut()[t]);
                let scalars = adamw::Scalars::new(lr, t, *beta1, *beta2, *eps, *weight_decay);
                let updates: Vec<adamw::Update> = updates
                    .iter()
                    .map(|u| adamw::Update {
                        p: self.off(u.p),
                        g: self.off(u.g),
                        m: self.off(u.m),
                        v: self.off(u.v),
                        p_out: self.off(u.p_out),
                        m_out: self.off(u.m_out),
                        v_out: self.off(u.v_out),
                        len: self.numel(u.p),
                    })
                    .collect();
                // SAFETY: every value lies in the arena; an output is either its own input
                // (donated, updated in place) or apart from every operand (the planner).
                unsafe { adamw::step(self.base, &updates, scalars) };
            }
            Step::CrossEntropy {
                out,
                logits,
                targets,
            } => {
                let (x, t) = self.cross_entropy_operands(logits, targets)?;
                // SAFETY: the views and the output lie in the arena.
                unsafe { cross_entropy::forward(self.base, x, &t, self.off(*out)) };
            }
            Step::CrossEntropyBackward {
                out,
                logits,
                targets,
                grad,
            } => {
                let (x, t) = self.cross_entropy_operands(logits, targets)?;
                let grad = self.off(*grad);
                let g = self.arena_mut()[grad];
                // SAFETY: as above; the planner never places an output over a live operand.
                unsafe { cross_entropy::backward(self.base, x, &t, g, self.off(*out)) };
            }
            Step::AttentionBackward {
                dq,
                dk,
                dv,
                q,
                k,
                v,
                dout,
                stats,
                causal,
                scale,
                bf16,
            } => {
                let d = attention_dims(q, k, *causal, *scale)?;
                let products = self.attention_products(*bf16);
                let stats = stats.map(|s| attention::Stats(self.off(s)));
                let grads = attention::Grads {
                    dq: self.output_heads(dq)?,
                    dk: self.output_heads(dk)?,
                    dv: self.output_heads(dv)?,
                };
                let (q, k, v, dout) = (
                    self.heads(q),
                    self.heads(k),
                    self.heads(v),
                    self.heads(dout),
                );
                // SAFETY: as for the forward step; the three outputs are distinct buffers.
                unsafe {
                    attention::backward(
                        self.base,
                        d,
                        products,
                        attention::Qkv { q, k, v },
                        dout,
                        stats,
                        grads,
                    )
                };
            }
            Step::Rope {
                out,
                x,
                theta,
                layout,
                inverse,
            } => {
                let [b, sq, h, d] = match x.shape.as_slice() {
                    &[b, s, h, d] if d % 2 == 0 => [b, s, h, d],
                    other => {
                        return Err(RuntimeError::Backend(format!(
                            "rope needs a [B, S, H, D] input with D even, got {other:?}"
                        )))
                    }
                };
                let mut strides = [0; 4];
                strides.copy_from_slice(&x.strides);
                // In halves where the input is stored in 2 bytes: the view counts halves.
                let halves = self.program.is_two_byte(x.base);
                let slot = self.off(x.base);
                let input = rope::Input {
                    offset: if halves { 2 * slot } else { slot } + x.offset,
                    shape: [b, sq, h, d],
                    strides,
                    halves,
                };
                let out = self.off(*out);
                let key = Tables::key(*theta, sq, d, *inverse);
                let tables = self
                    .rope_tables
                    .entry(key)
                    .or_insert_with(|| Tables::new(*theta, sq, d, *inverse));
                // SAFETY: the view and the output lie in the arena, apart (the planner never
                // places an output over a live operand).
                unsafe { rope::apply(self.base, input, out, *layout, tables) };
            }
            Step::CollectiveStart {
                collective,
                mesh_dims,
                src,
                handle,
            } => {
                let call = crate::comm::CollectiveCall::new(
                    g,
                    self.comm.rank(),
                    *collective,
                    mesh_dims,
                    (*src, self.base.wrapping_add(self.off(*src))),
                    (*handle, self.base.wrapping_add(self.off(*handle))),
                )?;
                // SAFETY: both buffers lie in the arena, which outlives the run; the plan keeps
                // `src` live and unwritten until the wait (which reads it), and no step but the
                // wait names `handle`, whose bytes are the wait's result.
                unsafe { self.comm.start(call)? };
            }
            Step::Wait { handle, .. } => self.comm.wait(handle.index())?,
            Step::Offload { src, out } => {
                let (at, n) = (self.off(*src), self.numel(*src));
                let from = self.arena_mut()[at..at + n].to_vec();
                self.host.insert(*out, from);
            }
            Step::Reload { src, out } => {
                let at = self.off(*out);
                let data = self.host.remove(src).ok_or_else(|| {
                    RuntimeError::Backend(format!(
                        "reload of value {} before its offload",
                        src.index()
                    ))
                })?;
                self.arena_mut()[at..at + data.len()].copy_from_slice(&data);
                self.host.insert(*src, data);
            }
            _ => unreachable!("not a host step"),
        }
        Ok(())
    }
}

/// One run of an index tensor's last dimension, as gather and scatter-add walk it.
struct IndexRow {
    /// Position of the run's first element in the (contiguous) index tensor.
    pos: usize,
    len: usize,
    /// Offset in the source of the run's first coordinates with the indexed axis zeroed, and
    /// its step per element along the run (0 when the run is the indexed axis itself).
    base: usize,
    step: usize,
}

impl IndexRow {
    /// The run's index when all its elements hold the same valid one.
    fn same_index(&self, idx: &[f32], bound: usize) -> Result<Option<usize>, RuntimeError> {
        let first = idx[0];
        if self.step == 0 || idx.iter().any(|&x| x != first) {
            return Ok(None);
        }
        check_index(first, bound, self.pos).map(Some)
    }
}

/// Calls `f` for every run of the last dimension of a contiguous index tensor of shape
/// `ishape`, in order, addressing a contiguous source of shape `sshape` indexed along `axis`.
/// The coordinates advance as an odometer, so there is no division per element (with one per
/// dimension and element, the embedding gather and its scatter-add took 10-17 ns per element).
fn for_each_row(
    ishape: &[usize],
    sshape: &[usize],
    axis: usize,
    mut f: impl FnMut(&IndexRow) -> Result<(), RuntimeError>,
) -> Result<(), RuntimeError> {
    let n: usize = ishape.iter().product();
    if n == 0 {
        return Ok(());
    }
    let Some(last) = ishape.len().checked_sub(1) else {
        return f(&IndexRow {
            pos: 0,
            len: 1,
            base: 0,
            step: 0,
        });
    };
    let sst = contiguous_strides(sshape);
    let step: Vec<usize> = (0..ishape.len())
        .map(|d| if d == axis { 0 } else { sst[d] })
        .collect();
    let mut coord = vec![0usize; last];
    let mut row = IndexRow {
        pos: 0,
        len: ishape[last],
        base: 0,
        step: step[last],
    };
    while row.pos < n {
        f(&row)?;
        row.pos += row.len;
        for d in (0..last).rev() {
            coord[d] += 1;
            row.base += step[d];
            if coord[d] < ishape[d] {
                break;
            }
            row.base -= step[d] * coord[d];
            coord[d] = 0;
        }
    }
    Ok(())
}

/// A matmul operand in the arena: f32 slots, or bf16 stored in 2 bytes.
type Operand = bf16_pack::Src;

/// The `[batch, rows, cols]` operand at `p` read through `layout`, rounded to bf16 (the identity
/// on the halves of a value stored in 2 bytes, which this widens) into a contiguous f32 copy
/// (one matrix where the batch stride is 0, as the operand shares it), with the copy's layout:
/// what the f32 GEMM reads for a bf16 product.
///
/// # Safety
/// `p` must address every element `layout` names for that shape.
unsafe fn rounded_copy(
    p: Operand,
    layout: Layout,
    batch: usize,
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Layout) {
    let batches = if layout.batch_stride == 0 { 1 } else { batch };
    let mut copy = Vec::with_capacity(batches * rows * cols);
    for bi in 0..batches {
        for i in 0..rows {
            for j in 0..cols {
                let at = bi * layout.batch_stride + i * layout.row_stride + j * layout.col_stride;
                // SAFETY: (bi, i, j) is inside the operand (the caller's contract).
                copy.push(graphtrain_ir::host_tensor::round_bf16(unsafe { p.get(at) }));
            }
        }
    }
    let copied = Layout {
        batch_stride: if batches == 1 { 0 } else { rows * cols },
        row_stride: cols,
        col_stride: 1,
    };
    (copy, copied)
}

fn check_index(x: f32, bound: usize, pos: usize) -> Result<usize, RuntimeError> {
    if x < 0.0 || x as usize >= bound || x.fract() != 0.0 {
        return Err(RuntimeError::Input(format!(
            "index {x} at position {pos} is out of range 0..{bound}"
        )));
    }
    Ok(x as usize)
}

impl Executor for CpuExecutor {
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
        self.sync()?;
        let o = self.off(v);
        let arena = self.arena_mut();
        for (d, s) in arena[o..o + t.data.len()].iter_mut().zip(&t.data) {
            *d = *s as f32;
        }
        Ok(())
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError> {
        self.sync()?;
        let ty = self.program.graph.ty(v).clone();
        let o = self.off(v);
        let n = ty.numel();
        let arena = self.arena_mut();
        let data = arena[o..o + n].iter().map(|&x| x as f64).collect();
        HostTensor::new(ty, data).map_err(|e| RuntimeError::Backend(e.to_string()))
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let started = Instant::now();
        let steps = std::mem::take(&mut self.program.steps);
        if let Some(r) = self.timeline.as_mut() {
            r.begin();
            self.comm.record_transfers(true);
        }
        let result = (|| {
            for (i, step) in steps.iter().enumerate() {
                let t = Instant::now();
                let lane = self.run_step(i, step)?;
                if self.profile.is_some() || self.timeline.is_some() {
                    self.sync()?;
                }
                if let Some(r) = self.timeline.as_mut() {
                    r.record(i, lane, t);
                }
                // The first run compiles kernels; it is left out of the profile.
                if let Some(p) = self.profile.as_mut().filter(|_| self.first_run.is_some()) {
                    let (mut key, flops) = profile_key(&self.program, step);
                    if self.profile_each_step && flops == 0.0 {
                        let mut what = format!("{step:?}");
                        what.truncate(300);
                        key = format!("#{i} {key}: {what}");
                    }
                    match p.iter_mut().find(|e| e.0 == key) {
                        Some(e) => {
                            e.1 += t.elapsed();
                            e.2 += 1;
                        }
                        None => p.push((key, t.elapsed(), 1, flops)),
                    }
                }
            }
            self.sync()
        })();
        self.program.steps = steps;
        if let Some(r) = self.timeline.as_mut() {
            r.transfers(&self.comm.take_transfers(), &self.program);
            self.comm.record_transfers(false);
            r.finish(&self.program);
        }
        if self.first_run.is_none() {
            self.first_run = Some(started.elapsed());
        }
        result
    }

    fn memory_bytes(&self) -> usize {
        self.len * 4
    }

    fn profile_report(&mut self) -> Option<String> {
        let shown = if self.profile_each_step { 120 } else { 30 };
        Some(profile_report(self.profile.as_mut()?, shown))
    }

    fn record_timeline(&mut self, on: bool) -> bool {
        Recorder::switch(&mut self.timeline, on);
        true
    }

    fn take_timeline(&mut self) -> Option<Timeline> {
        self.timeline.as_mut()?.take()
    }
}

impl CpuExecutor {
    /// Runs step `i`. A kernel step of a captured region runs its bound launches directly; any
    /// other kernel step is dispatched through cubecl; matmul and host steps run here, after
    /// the dispatched launches they may depend on. Returns the timeline lane it ran on.
    fn run_step(&mut self, i: usize, step: &Step) -> Result<u32, RuntimeError> {
        let captured = self
            .program
            .step_regions
            .get(i)
            .copied()
            .flatten()
            .is_some();
        if captured && self.bound[i].is_some() {
            self.sync()?;
            for launch in self.bound[i].as_ref().into_iter().flatten() {
                launch.run(Pool::current());
            }
            return Ok(timeline::KERNELS);
        }
        match self.launches().kernel_calls(step)? {
            Some(calls) if captured => {
                let mut bound = Vec::with_capacity(calls.len());
                for call in &calls {
                    bound.push(self.cache.bind(
                        call,
                        &self.client,
                        &self.arena,
                        self.base,
                        self.len,
                    )?);
                }
                self.bound[i] = Some(bound);
                self.run_step(i, step)
            }
            Some(calls) => {
                for call in &calls {
                    // SAFETY: every offset + count is inside the arena (the planner sized it).
                    unsafe {
                        call.dispatch(&self.client, &|_| Binding {
                            handle: self.arena.clone(),
                            elems: self.len,
                            base: 0,
                        })?
                    };
                }
                self.queued |= !calls.is_empty();
                Ok(timeline::KERNELS)
            }
            None => match step {
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
                    self.matmul(*out, a, b, *batch, *m, *n, *k, *bf16)?;
                    Ok(timeline::HOST)
                }
                _ => {
                    self.host_step(step)?;
                    Ok(timeline::HOST)
                }
            },
        }
    }
}

/// The whole 2 MiB blocks inside `[ptr, ptr + bytes)`, as (start, len): madvise needs an
/// aligned start, and the partial blocks at either end cannot be huge pages anyway.
fn huge_page_range(ptr: usize, bytes: usize) -> Option<(usize, usize)> {
    const HUGE: usize = 2 << 20;
    let start = ptr.checked_next_multiple_of(HUGE)?;
    let end = ptr.checked_add(bytes)? & !(HUGE - 1);
    (end > start).then(|| (start, end - start))
}

/// Asks Linux to back the arena with 2 MiB pages. Every kernel streams its operands through
/// the arena; with 4 KiB pages, `peer`'s 225 MiB takes 57,600 page-table entries where the
/// core's second-level TLB holds about 2,000, so GEMM panels and elementwise streams keep
/// missing it (the step ran about 2% faster on huge pages, paired in one process,
/// docs/benchmarks.md).
///
/// `MADV_HUGEPAGE` covers pages faulted in from now on, but cubecl zeroes the arena when it
/// allocates it, so its pages are already there. Converting them in place (`MADV_COLLAPSE`)
/// copies every page: 4.8 s of `debug`'s 6.6 s load for its 2 GiB arena. The arena holds
/// nothing of ours yet, only the zeros cubecl wrote, so its whole 2 MiB blocks are instead
/// handed back (`MADV_DONTNEED`: the heap's private anonymous pages read back as zeros, so the
/// program sees what it would have) and fault in again as huge pages when first touched. The
/// blocks lie wholly inside this arena's own range, so no other buffer is touched. Where the kernel
/// declines (an older kernel, THP set to `never`, no free 2 MiB blocks) the arena stays on small
/// pages, which is only slower.
#[cfg(target_os = "linux")]
fn back_with_huge_pages(ptr: *mut u8, bytes: usize) {
    const MADV_DONTNEED: i32 = 4;
    const MADV_HUGEPAGE: i32 = 14;
    extern "C" {
        fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
    }
    let Some((start, len)) = huge_page_range(ptr as usize, bytes) else {
        return;
    };
    // SAFETY: [start, start + len) lies inside this arena's allocation, which stays mapped while
    // the executor lives and holds only zeros yet (see above): its dropped pages read back as
    // the same zeros.
    unsafe {
        if madvise(start as *mut _, len, MADV_HUGEPAGE) == 0 {
            madvise(start as *mut _, len, MADV_DONTNEED);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn back_with_huge_pages(_ptr: *mut u8, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::huge_page_range;

    const MIB: usize = 1 << 20;

    #[test]
    fn huge_pages_cover_only_whole_aligned_blocks_inside_the_arena() {
        // Aligned both ends: all of it.
        assert_eq!(huge_page_range(4 * MIB, 6 * MIB), Some((4 * MIB, 6 * MIB)));
        // Ragged both ends: the aligned blocks strictly inside.
        assert_eq!(
            huge_page_range(4 * MIB + 64, 6 * MIB),
            Some((6 * MIB, 4 * MIB))
        );
        // No whole block inside: nothing to advise.
        assert_eq!(huge_page_range(MIB, 2 * MIB), None);
        assert_eq!(huge_page_range(2 * MIB, MIB), None);
        // Near the top of the address space: no overflow, no range.
        assert_eq!(huge_page_range(usize::MAX - MIB, 4 * MIB), None);
    }
}
