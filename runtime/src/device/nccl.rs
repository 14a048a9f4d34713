//! NCCL between the GPUs of a `cuda` run of several ranks (threads or MPI processes): each
//! collective moves device memory to device memory instead of staging through the host.
//!
//! - Joining: every mesh-dimension set the Program's collectives use gets one NCCL
//!   communicator per group. The group's first member draws NCCL's unique id and broadcasts it
//!   to the others through the rank's own `Communicator` (threads or MPI): that is how NCCL is
//!   bootstrapped without a network of our own. Every rank runs the same Program, so every rank
//!   joins the same groups in the same order, as `ncclCommInitRank` needs.
//! - Ordering against cubecl: a start waits for every launch queued before it (the operand is
//!   then written), then queues the block swaps (`nccl_plan.rs`) and the NCCL call on a stream
//!   of its own, so compute launched after the start runs beside the transfer. Scratch is
//!   allocated and freed in stream order on that stream. A wait polls the collective's event,
//!   so a stuck member turns into an error after the collective timeout (the MPI engine's,
//!   `RuntimeOptions::collective_timeout`) and the communicators are aborted, never a hang.
//! - Numerics: NCCL sums in its ring's order, not in group order as the threads and MPI
//!   engines do: a run agrees with them within rounding, not bit for bit. bf16 sums are rounded
//!   once after NCCL's f32 sum (the caller launches the rounding), as the other engines do.
//!
//! Status: built (CI runs `cargo check --features cuda`), not yet run on a GPU.

use super::nccl_plan::{NcclOp, NcclPlan, Swap};
use crate::comm::{CollectiveCall, Communicator};
use crate::RuntimeError;
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nccl, sys as ncclsys};
use graphtrain_ir::{Collective, Reduce};
use graphtrain_lowering::{Program, Step};
use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Ids of the bootstrap broadcasts, apart from every handle id (value indices).
const BOOTSTRAP_ID: usize = usize::MAX / 2;

struct Group {
    comm: ncclsys::ncclComm_t,
    members: usize,
}

struct InFlight {
    done: cusys::CUevent,
    sequence: u64,
    what: String,
    /// The result's elements to round to bf16 once the collective is done.
    round: Option<(usize, usize)>,
}

pub(crate) struct Nccl {
    context: cusys::CUcontext,
    stream: cusys::CUstream,
    /// The device address of the arena's first element.
    arena: u64,
    groups: HashMap<Vec<usize>, Group>,
    in_flight: HashMap<usize, InFlight>,
    started: u64,
    timeout: Duration,
}

// SAFETY: the context, stream, events and communicators are handles that CUDA and NCCL allow
// on any thread once the context is current, which `Nccl` makes it before every call; one
// executor uses them, from one thread at a time.
unsafe impl Send for Nccl {}

fn driver(what: &str) -> impl Fn(cu::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Backend(format!("NCCL collectives: {what} failed: {e:?}"))
}

fn nccl_error(what: &str) -> impl Fn(nccl::NcclError) -> RuntimeError + '_ {
    move |e| RuntimeError::Backend(format!("NCCL: {what} failed: {:?}", e.0))
}

impl Nccl {
    /// Joins the NCCL groups of `program`'s collectives, for the rank `comm` is, on device
    /// `ordinal`, whose arena starts at device address `arena`.
    pub(crate) fn join(
        program: &Program,
        comm: &dyn Communicator,
        ordinal: usize,
        arena: u64,
        timeout: Duration,
    ) -> Result<Nccl, RuntimeError> {
        // cudarc loads libnccl on first use and panics when it is missing: say so instead.
        let version = std::panic::catch_unwind(nccl::get_nccl_version).map_err(|_| {
            RuntimeError::Unavailable(
                "the cuda backend's collectives need NCCL (libnccl.so.2), which was not found: \
install it, or run with --tuning device_collectives=host (collectives through host memory)"
                    .to_string(),
            )
        })?;
        version.map_err(nccl_error("reading the library's version"))?;
        // SAFETY: the ordinal was opened by cubecl; the primary context is the one it uses.
        let context = unsafe {
            let device = cu::device::get(ordinal as i32).map_err(driver("finding the device"))?;
            cu::primary_ctx::retain(device).map_err(driver("retaining the context"))?
        };
        // SAFETY: a context just retained.
        unsafe { cu::ctx::set_current(context) }.map_err(driver("making the context current"))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(driver("creating its stream"))?;
        let mut world = Nccl {
            context,
            stream,
            arena,
            groups: HashMap::new(),
            in_flight: HashMap::new(),
            started: 0,
            timeout,
        };
        let g = &program.graph;
        let mesh = g
            .mesh
            .as_ref()
            .ok_or_else(|| RuntimeError::Lower("NCCL for a program without a mesh".to_string()))?;
        let rank = comm.rank();
        for step in &program.steps {
            let Step::CollectiveStart { mesh_dims, .. } = step else {
                continue;
            };
            if world.groups.contains_key(mesh_dims) {
                continue;
            }
            let group = mesh.group(rank, mesh_dims);
            let member = mesh.group_index(rank, mesh_dims);
            let id = world.bootstrap(comm, mesh_dims, &group, member)?;
            let mut handle = std::ptr::null_mut();
            // SAFETY: `handle` is written by NCCL; every member calls with the same id and size.
            unsafe {
                nccl::comm_init_rank(&mut handle, group.len() as i32, id, member as i32)
                    .map_err(nccl_error("joining a group (ncclCommInitRank)"))?;
            }
            world.groups.insert(
                mesh_dims.clone(),
                Group {
                    comm: handle,
                    members: group.len(),
                },
            );
        }
        Ok(world)
    }

    /// NCCL's unique id for `group`, drawn by its first member and broadcast to the rest over
    /// `comm` (its 128 bytes as 32 f32, which every engine moves bit for bit).
    fn bootstrap(
        &self,
        comm: &dyn Communicator,
        mesh_dims: &[usize],
        group: &[usize],
        member: usize,
    ) -> Result<ncclsys::ncclUniqueId, RuntimeError> {
        let mut bytes = [0u8; 128];
        if member == 0 {
            let id = nccl::get_uniqueid().map_err(nccl_error("drawing a unique id"))?;
            for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
                *b = *c as u8;
            }
        }
        let src: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut dst = vec![0f32; src.len()];
        let id = BOOTSTRAP_ID + self.groups.len();
        let call = CollectiveCall {
            id,
            collective: Collective::Broadcast { root: 0 },
            mesh_dims: mesh_dims.to_vec(),
            group: group.to_vec(),
            member,
            src: src.as_ptr(),
            src_shape: vec![src.len()],
            dst: dst.as_mut_ptr(),
            dst_len: dst.len(),
            round_bf16: false,
        };
        // SAFETY: both vectors outlive the wait below and are not touched until it returns.
        unsafe { comm.start(call)? };
        comm.wait(id)?;
        let mut id = ncclsys::ncclUniqueId { internal: [0; 128] };
        for (i, x) in dst.iter().enumerate() {
            for (j, b) in x.to_ne_bytes().iter().enumerate() {
                id.internal[i * 4 + j] = *b as _;
            }
        }
        Ok(id)
    }

    fn current(&self) -> Result<(), RuntimeError> {
        // SAFETY: the context was retained in `join` and is released only on drop.
        unsafe { cu::ctx::set_current(self.context) }.map_err(driver("making the context current"))
    }

    /// Queues the collective `call` (whose operand and result are the arena's elements at
    /// `src_at` and `dst_at`) on NCCL's stream. Every launch that writes the operand must have
    /// completed (the caller synchronizes first).
    ///
    /// # Safety
    /// `src_at` and `dst_at` must address the call's operand and result inside the arena,
    /// untouched by other launches until `wait(call.id)` returns.
    pub(crate) unsafe fn start(
        &mut self,
        call: &CollectiveCall,
        src_at: usize,
        dst_at: usize,
    ) -> Result<(), RuntimeError> {
        self.current()?;
        let group = self.groups.get(&call.mesh_dims).ok_or_else(|| {
            RuntimeError::Backend(format!(
                "NCCL: no group was joined for mesh dimensions {:?}",
                call.mesh_dims
            ))
        })?;
        let plan = NcclPlan::new(
            call.collective,
            group.members,
            &call.src_shape,
            call.round_bf16,
        );
        let comm = group.comm;
        let stream = self.stream;
        let nccl_stream = stream as ncclsys::cudaStream_t;
        let f32s = ncclsys::ncclDataType_t::ncclFloat32;
        let src = self.arena + (src_at * 4) as u64;
        let dst = self.arena + (dst_at * 4) as u64;
        let (pack_len, unpack_len) = plan.scratch_lens();
        let send = match plan.pack {
            Some(swap) => {
                let scratch = cu::malloc_async(stream, pack_len * 4).map_err(driver("scratch"))?;
                swap_blocks(swap, src, scratch, stream)?;
                scratch
            }
            None => src,
        };
        let recv = if plan.unpack.is_some() {
            cu::malloc_async(stream, unpack_len * 4).map_err(driver("scratch"))?
        } else {
            dst
        };
        let (sendp, recvp) = (send as *const c_void, recv as *mut c_void);
        let op = |reduce: Reduce| match reduce {
            Reduce::Sum => ncclsys::ncclRedOp_t::ncclSum,
            Reduce::Avg => ncclsys::ncclRedOp_t::ncclAvg,
        };
        let what = format!("{:?} over ranks {:?}", call.collective, call.group);
        let failed = |e: nccl::NcclError| {
            RuntimeError::Backend(format!("NCCL: {what} failed to start: {:?}", e.0))
        };
        let count = plan.count;
        match plan.op {
            NcclOp::AllReduce { reduce } => {
                nccl::all_reduce(sendp, recvp, count, f32s, op(reduce), comm, nccl_stream)
            }
            NcclOp::ReduceScatter { reduce } => {
                nccl::reduce_scatter(sendp, recvp, count, f32s, op(reduce), comm, nccl_stream)
            }
            NcclOp::AllGather => nccl::all_gather(sendp, recvp, count, f32s, comm, nccl_stream),
            NcclOp::Broadcast { root } => {
                nccl::broadcast(sendp, recvp, count, f32s, root as i32, comm, nccl_stream)
            }
            NcclOp::AllToAll => {
                nccl::group_start().map_err(failed)?;
                for peer in 0..group.members {
                    let at = (peer * count * 4) as u64;
                    let to = (send + at) as *const c_void;
                    let from = (recv + at) as *mut c_void;
                    nccl::send(to, count, f32s, peer as i32, comm, nccl_stream).map_err(failed)?;
                    nccl::recv(from, count, f32s, peer as i32, comm, nccl_stream)
                        .map_err(failed)?;
                }
                nccl::group_end()
            }
        }
        .map_err(failed)?;
        if let Some(swap) = plan.unpack {
            swap_blocks(swap, recv, dst, stream)?;
            cu::free_async(recv, stream).map_err(driver("freeing scratch"))?;
        }
        if plan.pack.is_some() {
            cu::free_async(send, stream).map_err(driver("freeing scratch"))?;
        }
        let done = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver("creating an event"))?;
        cu::event::record(done, stream).map_err(driver("recording an event"))?;
        self.in_flight.insert(
            call.id,
            InFlight {
                done,
                sequence: self.started,
                what,
                round: plan.round_bf16.then_some((dst_at, plan.dst_len)),
            },
        );
        self.started += 1;
        Ok(())
    }

    /// Returns once the collective started as `id` is done: the result's elements to round to
    /// bf16, if it sums bf16. A collective not done within the timeout aborts every group and
    /// fails, naming it.
    pub(crate) fn wait(&mut self, id: usize) -> Result<Option<(usize, usize)>, RuntimeError> {
        self.current()?;
        let flight = self.in_flight.remove(&id).ok_or_else(|| {
            RuntimeError::Input(format!("a wait for collective {id}, which has not started"))
        })?;
        let began = Instant::now();
        loop {
            // SAFETY: an event created and recorded in `start`, destroyed only below.
            match unsafe { cu::event::query(flight.done) } {
                Ok(()) => break,
                Err(cu::DriverError(cusys::cudaError_enum::CUDA_ERROR_NOT_READY)) => {
                    if began.elapsed() > self.timeout {
                        self.abort();
                        return Err(RuntimeError::Input(format!(
                            "NCCL collective #{} ({}) did not finish within {:.0} s: another \
member is stuck or dead (GRAPHTRAIN_COLLECTIVE_TIMEOUT_S sets the limit)",
                            flight.sequence,
                            flight.what,
                            self.timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
                Err(e) => {
                    return Err(RuntimeError::Backend(format!(
                        "NCCL collective #{} ({}) failed: {e:?}",
                        flight.sequence, flight.what
                    )))
                }
            }
        }
        // SAFETY: the event is done and used nowhere else.
        unsafe { cu::event::destroy(flight.done) }.map_err(driver("destroying an event"))?;
        Ok(flight.round)
    }

    /// Aborts every group: members blocked in NCCL return instead of hanging.
    fn abort(&mut self) {
        for (_, group) in self.groups.drain() {
            // SAFETY: a communicator joined in `join`, dropped from the map here.
            let _ = unsafe { nccl::comm_abort(group.comm) };
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if self.current().is_err() {
            return;
        }
        // SAFETY: handles created in `join`/`start`, used by nothing after this.
        unsafe {
            let _ = cu::stream::synchronize(self.stream);
            for (_, flight) in self.in_flight.drain() {
                let _ = cu::event::destroy(flight.done);
            }
            for (_, group) in self.groups.drain() {
                let _ = nccl::comm_destroy(group.comm);
            }
            let _ = cu::stream::destroy(self.stream);
        }
    }
}

/// `swap` from device address `src` to `dst` on `stream`: one strided 2-D copy per column
/// block (`cols` of them, each `rows` rows of `chunk` elements).
///
/// # Safety
/// Both ranges must hold `rows · cols · chunk` f32 and stay valid until the stream reaches the
/// copies.
unsafe fn swap_blocks(
    swap: Swap,
    src: u64,
    dst: u64,
    stream: cusys::CUstream,
) -> Result<(), RuntimeError> {
    let Swap { rows, cols, chunk } = swap;
    let width = chunk * 4;
    for c in 0..cols {
        let copy = cusys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cusys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src + (c * width) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: cols * width,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: cusys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst + (c * rows * width) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: width,
            WidthInBytes: width,
            Height: rows,
        };
        cusys::cuMemcpy2DAsync_v2(&copy, stream)
            .result()
            .map_err(driver("a block swap (cuMemcpy2DAsync)"))?;
    }
    Ok(())
}
