//! Ranks as threads of one process (`--launcher threads`): every rank of an SPMD graph's mesh
//! gets a thread, its own executor of the same Program, its own share of the cores (a pool of
//! `threads_per_rank`, `Pool::for_rank`), and a `ThreadComm` of one `ThreadWorld`, through
//! which its collectives meet the other ranks' in shared memory.
//!
//! `ThreadRanks` is itself an `Executor` over global tensors, so a caller written for one device
//! (the trainer, `bench`) runs a mesh unchanged:
//! - `write(v, t)` takes the global tensor of input `v` and writes each rank its part
//!   (`graphtrain_ir::mesh::local_part`, from the input's placement);
//! - `read(v)` assembles the global tensor from the ranks' parts (an input's or output's
//!   placement); a value without one (an intermediate) is read from rank 0;
//! - `run` runs every rank's step at once and returns when all have finished; the first rank
//!   to fail aborts the world, so the others stop at their next wait with an error instead of
//!   waiting forever, and the error names the failed rank.
//!
//! `graph()` is the rank-local graph (local types, placements on inputs and outputs); the
//! global type of an input or output follows from its placement (`global_type`).
//!
//! On `wgpu` and `cuda` each rank's executor is a `DeviceExecutor` on the one device, its own
//! arena there, its collectives staged through host memory (`device`'s module docs).
//!
//! Declines, before any thread starts: a graph without a mesh, the reference backend (its
//! ranks are `ReferenceExecutor`s, loaded one per communicator), `threads_per_rank` of 0.

use crate::comm::{Communicator, ThreadComm, ThreadWorld};
use crate::cpu::pool::Pool;
use crate::cpu::CpuExecutor;
use crate::device::{DeviceExecutor, DeviceKind};
use crate::timeline::Timeline;
use crate::{Backend, Compiled, Executor, RuntimeError};
use graphtrain_ir::mesh::{assemble, local_part};
use graphtrain_ir::{Graph, HostTensor, Mesh, Placements, TensorType, ValueId};
use graphtrain_lowering::Program;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

type Job = Box<dyn FnOnce(&mut dyn Executor) -> Box<dyn std::any::Any + Send> + Send>;

/// `f` as a job for a rank's thread, its answer boxed.
fn job<R: Send + 'static>(f: impl FnOnce(&mut dyn Executor) -> R + Send + 'static) -> Job {
    Box::new(move |exec: &mut dyn Executor| Box::new(f(exec)) as Box<dyn std::any::Any + Send>)
}

struct Rank {
    jobs: Sender<Job>,
    replies: Receiver<Box<dyn std::any::Any + Send>>,
    thread: Option<JoinHandle<()>>,
}

/// Every rank of a mesh, each on its own thread, behind one `Executor`.
pub struct ThreadRanks {
    graph: Graph,
    program: Option<Program>,
    mesh: Mesh,
    ranks: Vec<Rank>,
    /// Answers `communicator()`: rank 0 of the world (the ranks' own run the collectives).
    world: RankGroupView,
    memory_bytes: usize,
    /// Per rank, time blocked in waits during the last `run`, and the part of it before every
    /// member had started.
    blocked: Vec<(Duration, Duration)>,
}

/// What `ThreadRanks::communicator` shows: the world's size, seen from rank 0.
struct RankGroupView {
    world_size: usize,
}

impl Communicator for RankGroupView {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    unsafe fn start(&self, _call: crate::comm::CollectiveCall) -> Result<(), RuntimeError> {
        Err(RuntimeError::Backend(
            "collectives run on the ranks' own threads, not through the rank group".into(),
        ))
    }

    fn wait(&self, _id: usize) -> Result<(), RuntimeError> {
        Err(RuntimeError::Backend(
            "collectives run on the ranks' own threads, not through the rank group".into(),
        ))
    }
}

impl Compiled {
    /// Loads the step on every rank of its graph's mesh, each rank a thread with
    /// `threads_per_rank` compute threads.
    pub fn load_ranks(self, threads_per_rank: usize) -> Result<Box<dyn Executor>, RuntimeError> {
        self.load_ranks_over(threads_per_rank, Vec::new())
    }

    /// `load_ranks` with an emulated network link per mesh dimension (`ThreadWorld`).
    pub fn load_ranks_over(
        self,
        threads_per_rank: usize,
        links: Vec<Option<crate::comm::Link>>,
    ) -> Result<Box<dyn Executor>, RuntimeError> {
        let mesh = self.graph.mesh.clone().ok_or_else(|| {
            RuntimeError::Input(
                "ranks as threads need an SPMD graph (one with a mesh); this one has none".into(),
            )
        })?;
        let device = match self.backend {
            Backend::Cpu => None,
            Backend::Wgpu => Some(DeviceKind::Wgpu),
            Backend::Cuda => Some(DeviceKind::Cuda),
            Backend::Reference => {
                return Err(RuntimeError::Unavailable(
                    "ranks as threads run a lowered Program (cpu, wgpu, cuda); the reference \
interpreter's ranks are loaded one per communicator"
                        .into(),
                ))
            }
        };
        if threads_per_rank == 0 {
            return Err(RuntimeError::Input(
                "threads per rank must be at least 1".into(),
            ));
        }
        let program = self.program.ok_or_else(|| {
            RuntimeError::Lower("the cpu backend needs a Program, and none was lowered".into())
        })?;
        let world_size = mesh.world_size();
        let mut ranks = Vec::with_capacity(world_size);
        let mut loaded = Vec::with_capacity(world_size);
        for (rank, comm) in ThreadWorld::communicators_over(world_size, links)
            .into_iter()
            .enumerate()
        {
            let (jobs, job_rx) = channel::<Job>();
            let (reply_tx, replies) = channel();
            let (load_tx, load_rx) = channel();
            let program = program.clone();
            let runtime = self.runtime.clone();
            let thread = std::thread::Builder::new()
                .name(format!("graphtrain-rank-{rank}"))
                .spawn(move || {
                    Pool::for_rank(rank, threads_per_rank).use_on_this_thread();
                    rank_main(program, device, runtime, comm, job_rx, reply_tx, load_tx)
                })
                .map_err(|e| RuntimeError::Backend(format!("cannot start rank {rank}: {e}")))?;
            ranks.push(Rank {
                jobs,
                replies,
                thread: Some(thread),
            });
            loaded.push(load_rx);
        }
        let mut memory_bytes = 0;
        for (rank, rx) in loaded.into_iter().enumerate() {
            let bytes = rx
                .recv()
                .map_err(|_| RuntimeError::Backend(format!("rank {rank} stopped while loading")))?
                .map_err(|e| at_rank(rank, e))?;
            memory_bytes = memory_bytes.max(bytes);
        }
        Ok(Box::new(ThreadRanks {
            graph: program.graph.clone(),
            program: Some(program),
            mesh,
            ranks,
            world: RankGroupView { world_size },
            memory_bytes,
            blocked: vec![(Duration::ZERO, Duration::ZERO); world_size],
        }))
    }
}

/// A rank's thread: loads its executor, then runs the jobs it is sent until the channel closes.
fn rank_main(
    program: Program,
    device: Option<DeviceKind>,
    runtime: crate::RuntimeOptions,
    comm: ThreadComm,
    jobs: Receiver<Job>,
    replies: Sender<Box<dyn std::any::Any + Send>>,
    loaded: Sender<Result<usize, RuntimeError>>,
) {
    let exec: Result<Box<dyn Executor>, RuntimeError> = match device {
        None => CpuExecutor::new(program, runtime, Box::new(comm))
            .map(|e| Box::new(e) as Box<dyn Executor>),
        Some(kind) => DeviceExecutor::new(program, kind, runtime, Box::new(comm))
            .map(|e| Box::new(e) as Box<dyn Executor>),
    };
    let mut exec = match exec {
        Ok(exec) => exec,
        Err(e) => {
            let _ = loaded.send(Err(e));
            return;
        }
    };
    let _ = loaded.send(Ok(exec.memory_bytes()));
    for job in jobs {
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(exec.as_mut())))
            .unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                exec.communicator().abort(&why);
                Box::new(Err::<(), RuntimeError>(RuntimeError::Backend(format!(
                    "panicked: {why}"
                ))))
            });
        if replies.send(reply).is_err() {
            return;
        }
    }
}

impl ThreadRanks {
    /// Sends `job` to every rank at once, then collects every answer (rank order).
    fn on_all<R: Send + 'static>(
        &mut self,
        f: impl Fn(usize, &mut dyn Executor) -> R + Send + Sync + Clone + 'static,
    ) -> Result<Vec<R>, RuntimeError> {
        let jobs = (0..self.ranks.len())
            .map(|rank| {
                let f = f.clone();
                job(move |exec| f(rank, exec))
            })
            .collect();
        self.run_jobs(jobs)
    }

    /// Sends `jobs[r]` to rank r, then takes every rank's answer (rank order) before returning
    /// the first error, so that no answer is left queued for the next job to mistake for its
    /// own.
    fn run_jobs<R: Send + 'static>(&mut self, jobs: Vec<Job>) -> Result<Vec<R>, RuntimeError> {
        let mut first_error = None;
        let mut sent = vec![false; self.ranks.len()];
        for ((rank, r), job) in self.ranks.iter().enumerate().zip(jobs) {
            match r.jobs.send(job) {
                Ok(()) => sent[rank] = true,
                Err(_) => {
                    first_error.get_or_insert(stopped(rank));
                }
            }
        }
        let mut out = Vec::with_capacity(self.ranks.len());
        for (rank, r) in self
            .ranks
            .iter()
            .enumerate()
            .filter(|(rank, _)| sent[*rank])
        {
            let reply = match r.replies.recv() {
                Ok(reply) => reply,
                Err(_) => {
                    first_error.get_or_insert(stopped(rank));
                    continue;
                }
            };
            match reply.downcast::<R>() {
                Ok(v) => out.push(*v),
                // The job panicked: its thread answered with the panic as an error.
                Err(other) => {
                    let e = match other.downcast::<Result<(), RuntimeError>>() {
                        Ok(result) => match *result {
                            Err(e) => e,
                            Ok(()) => RuntimeError::Backend("a job's answer was lost".into()),
                        },
                        Err(_) => RuntimeError::Backend("a job's answer was lost".into()),
                    };
                    first_error.get_or_insert(at_rank(rank, e));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// `job` on rank 0 alone: what the run reports of one rank (its profile, its timeline).
    /// `None` where rank 0's thread has stopped or the job panicked.
    fn on_rank_zero<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut dyn Executor) -> R + Send + 'static,
    ) -> Option<R> {
        let rank = self.ranks.first()?;
        rank.jobs.send(job(f)).ok()?;
        rank.replies.recv().ok()?.downcast::<R>().ok().map(|r| *r)
    }

    /// How value `v`'s local tensors make up its global one: an input's or an output's
    /// placement, if it has one.
    fn placement_of(&self, v: ValueId) -> Option<&Placements> {
        self.graph
            .inputs
            .iter()
            .find(|i| i.value == v)
            .and_then(|i| i.placement.as_ref())
            .or_else(|| {
                self.graph
                    .outputs
                    .iter()
                    .find(|o| o.value == v)
                    .and_then(|o| o.placement.as_ref())
            })
    }
}

fn stopped(rank: usize) -> RuntimeError {
    RuntimeError::Backend(format!("rank {rank}'s thread has stopped"))
}

fn at_rank(rank: usize, e: RuntimeError) -> RuntimeError {
    let message = format!("rank {rank}: {e}");
    match e {
        RuntimeError::Input(_) => RuntimeError::Input(message),
        RuntimeError::DoesNotFit(_) => RuntimeError::DoesNotFit(message),
        _ => RuntimeError::Backend(message),
    }
}

/// The global type of a value whose rank-local type is `local`, placed by `placement`.
pub fn global_type(mesh: &Mesh, local: &TensorType, placement: Option<&Placements>) -> TensorType {
    match placement {
        Some(p) => TensorType::new(local.dtype, p.global_shape(mesh, &local.shape)),
        None => local.clone(),
    }
}

impl Executor for ThreadRanks {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn program(&self) -> Option<&Program> {
        self.program.as_ref()
    }

    fn communicator(&self) -> &dyn Communicator {
        &self.world
    }

    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
        let local = self.graph.ty(v).clone();
        let placement = self.placement_of(v).cloned();
        let want = global_type(&self.mesh, &local, placement.as_ref());
        if t.ty != want {
            return Err(RuntimeError::Input(format!(
                "value {v:?} is {want} over mesh {} ({local} per rank), got {}",
                self.mesh, t.ty
            )));
        }
        // Every part is cut before any is sent: an error leaves no rank's answer pending.
        let parts = (0..self.ranks.len())
            .map(|rank| match &placement {
                Some(p) => local_part(t, p, &self.mesh, rank)
                    .map_err(|e| RuntimeError::Input(format!("value {v:?}: {e}"))),
                None => Ok(t.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let jobs = parts
            .into_iter()
            .map(|part| job(move |exec| exec.write(v, &part)))
            .collect();
        let written: Vec<Result<(), RuntimeError>> = self.run_jobs(jobs)?;
        for (rank, result) in written.into_iter().enumerate() {
            result.map_err(|e| at_rank(rank, e))?;
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let results = self.on_all(|_, exec| {
            let result = exec.run();
            // Whether this rank's failure came first, not from another rank's abort.
            let first = match &result {
                Err(e) => exec.communicator().abort(&e.to_string()),
                Ok(()) => false,
            };
            let comm = exec.communicator();
            (
                result,
                first,
                (comm.take_blocked(), comm.take_blocked_for_peers()),
            )
        })?;
        let mut errors = Vec::new();
        for (rank, (result, first, blocked)) in results.into_iter().enumerate() {
            self.blocked[rank] = blocked;
            if let Err(e) = result {
                errors.push((!first, at_rank(rank, e)));
            }
        }
        // The rank that failed first, rather than those its abort stopped.
        errors.sort_by_key(|(stopped_by_another, _)| *stopped_by_another);
        match errors.into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError> {
        let parts: Vec<HostTensor> = self
            .on_all(move |_, exec| exec.read(v))?
            .into_iter()
            .enumerate()
            .map(|(rank, r)| r.map_err(|e| at_rank(rank, e)))
            .collect::<Result<_, _>>()?;
        match self.placement_of(v) {
            Some(p) => assemble(&parts.iter().collect::<Vec<_>>(), p, &self.mesh)
                .map_err(|e| RuntimeError::Backend(format!("value {v:?}: {e}"))),
            None => Ok(parts.into_iter().next().expect("a mesh has a rank")),
        }
    }

    fn memory_bytes(&self) -> usize {
        self.memory_bytes
    }

    fn profile_report(&mut self) -> Option<String> {
        self.on_rank_zero(|exec| exec.profile_report()).flatten()
    }

    fn record_timeline(&mut self, on: bool) -> bool {
        self.on_all(move |_, exec| exec.record_timeline(on))
            .is_ok_and(|all| all.into_iter().all(|recorded| recorded))
    }

    fn take_timeline(&mut self) -> Option<Timeline> {
        self.on_rank_zero(|exec| exec.take_timeline()).flatten()
    }

    fn take_rank_timelines(&mut self) -> Vec<Timeline> {
        let taken = self
            .on_all(|_, exec| exec.take_timeline())
            .unwrap_or_default();
        // All or nothing: a rank without one would shift the others' rank numbers.
        taken
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default()
    }

    fn blocked_in_waits(&self) -> Vec<Duration> {
        self.blocked.iter().map(|b| b.0).collect()
    }

    fn blocked_for_peers(&self) -> Vec<Duration> {
        self.blocked.iter().map(|b| b.1).collect()
    }
}

impl Drop for ThreadRanks {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            // Closing the channel ends the rank's loop.
            let (closed, _) = channel::<Job>();
            r.jobs = closed;
        }
        for r in &mut self.ranks {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
