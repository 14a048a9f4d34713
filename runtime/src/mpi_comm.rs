//! Ranks as processes (`--launcher mpi`): one process per rank, started by `mpirun` (or a
//! cluster's `srun`), with MPI moving the data. The executor sees the same `Communicator` as
//! with threads.
//!
//! One thread of the process, the MPI thread, makes every MPI call (MPI is initialized there,
//! `MPI_THREAD_FUNNELED`): it serves requests in the order they are posted, which is the order
//! the rank starts its collectives, so it is also the rank's communication stream (compute goes
//! on while it works). Each group of a collective (the ranks that differ only along its mesh
//! dimensions) gets its own MPI communicator, split from the world the first time a collective
//! runs over those dimensions; every rank reaches that point at the same place of the same
//! Program, so the split is collective as MPI needs.
//!
//! A collective gathers every member's operand (`MPI_Allgather`), then computes the rank's
//! result with the same code as the threads engine, summing members in group order: a run is
//! bitwise the threads engine's on the same mesh. That moves each operand to every member,
//! more than a ring reduce-scatter would; bit-for-bit agreement comes first. bf16 operands
//! (mixed precision's gathered weights and their gradients) move 2 bytes per element.
//!
//! A wait that does not complete within the timeout (`RuntimeOptions::collective_timeout`, which
//! the CLI reads from `GRAPHTRAIN_COLLECTIVE_TIMEOUT_S`, default 300) fails with the collective's sequence number, kind and group instead of hanging: another
//! member is stuck or dead. Which one is not known from here (MPI does not say), so the rank
//! writes its last collectives, started and finished, to `graphtrain-rankR-collectives.txt` (in
//! `RuntimeOptions::flight_dir`, from `GRAPHTRAIN_FLIGHT_DIR`, default the working directory): the ranks' files side by side show
//! where each stopped.
//!
//! `finish` must run before the process exits (MPI_Finalize); `mpirun` treats a rank that
//! exits without it as failed.

use crate::comm::{combine, CollectiveCall, Communicator};
use crate::RuntimeError;
use mpi::collective::CommunicatorCollectives;
use mpi::datatype::PartitionMut;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::Count;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// This process's place in the MPI job, and the way to its MPI thread.
pub struct MpiWorld {
    rank: usize,
    size: usize,
    requests: Mutex<Option<Sender<Request>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

enum Request {
    Collective {
        call: CollectiveCall,
        done: Sender<Result<(), String>>,
    },
    /// Every rank's bytes, in rank order (lengths may differ).
    GatherBytes {
        bytes: Vec<u8>,
        reply: Sender<Vec<Vec<u8>>>,
    },
}

// SAFETY: a collective's raw pointers are only dereferenced on the MPI thread, under
// `Communicator::start`'s contract (valid until its wait returns).
unsafe impl Send for Request {}

static WORLD: OnceLock<Result<MpiWorld, String>> = OnceLock::new();

/// The MPI job this process is a rank of, initializing MPI on first use.
pub fn world() -> Result<&'static MpiWorld, RuntimeError> {
    WORLD
        .get_or_init(MpiWorld::start)
        .as_ref()
        .map_err(|e| RuntimeError::Input(e.clone()))
}

/// Ends MPI (waits for the MPI thread, which finalizes it), if it was started.
pub fn finish() {
    if let Some(Ok(w)) = WORLD.get() {
        w.requests.lock().expect("not poisoned").take();
        if let Some(t) = w.thread.lock().expect("not poisoned").take() {
            let _ = t.join();
        }
    }
}

impl MpiWorld {
    fn start() -> Result<MpiWorld, String> {
        let (tx, rx) = channel::<Request>();
        let (ready_tx, ready_rx) = channel::<Result<(usize, usize), String>>();
        let thread = std::thread::Builder::new()
            .name("graphtrain-mpi".into())
            .spawn(move || serve(rx, ready_tx))
            .map_err(|e| format!("cannot start the MPI thread: {e}"))?;
        let (rank, size) = ready_rx
            .recv()
            .map_err(|_| "the MPI thread stopped while initializing MPI".to_string())??;
        Ok(MpiWorld {
            rank,
            size,
            requests: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn post(&self, request: Request) -> Result<(), RuntimeError> {
        let sender = self.requests.lock().expect("not poisoned");
        sender
            .as_ref()
            .ok_or_else(|| RuntimeError::Input("MPI has been finalized".into()))?
            .send(request)
            .map_err(|_| RuntimeError::Input("the MPI thread has stopped".into()))
    }

    /// Every rank's `bytes`, in rank order: a collective over the whole job, so every rank
    /// must call it at the same point.
    pub fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, RuntimeError> {
        let (reply, answer) = channel();
        self.post(Request::GatherBytes { bytes, reply })?;
        answer
            .recv()
            .map_err(|_| RuntimeError::Input("the MPI thread stopped during a gather".into()))
    }

    /// The communicator an executor of this rank is given, with `options`' collective timeout
    /// and flight-record directory.
    pub fn communicator(&'static self, options: &crate::RuntimeOptions) -> MpiComm {
        MpiComm {
            world: self,
            pending: Mutex::new(HashMap::new()),
            started: Mutex::new(0),
            timeout: options.collective_timeout(),
            flight_dir: options
                .flight_dir
                .clone()
                .unwrap_or_else(|| std::path::PathBuf::from(".")),
            history: Mutex::new(VecDeque::with_capacity(HISTORY)),
            epoch: Instant::now(),
        }
    }
}

/// The MPI thread: initializes MPI, then serves requests in order until the senders are gone,
/// then finalizes MPI (dropping the universe).
fn serve(requests: Receiver<Request>, ready: Sender<Result<(usize, usize), String>>) {
    let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
        let _ = ready.send(Err("MPI was already initialized in this process".into()));
        return;
    };
    let world = universe.world();
    let _ = ready.send(Ok((world.rank() as usize, world.size() as usize)));
    let mut groups: HashMap<Vec<usize>, SimpleCommunicator> = HashMap::new();
    for request in requests {
        match request {
            Request::Collective { call, done } => {
                let result = run_collective(&world, &mut groups, &call);
                let _ = done.send(result);
            }
            Request::GatherBytes { bytes, reply } => {
                let _ = reply.send(gather_bytes(&world, &bytes));
            }
        }
    }
    drop(groups);
    drop(universe);
}

fn run_collective(
    world: &SimpleCommunicator,
    groups: &mut HashMap<Vec<usize>, SimpleCommunicator>,
    call: &CollectiveCall,
) -> Result<(), String> {
    if !groups.contains_key(&call.mesh_dims) {
        // The group's first rank names it; members keep their world order, which is group order.
        let color = Color::with_value(call.group[0] as i32);
        let sub = world
            .split_by_color(color)
            .ok_or("MPI_Comm_split gave no communicator")?;
        groups.insert(call.mesh_dims.clone(), sub);
    }
    let comm = &groups[&call.mesh_dims];
    let n = call.group.len();
    if comm.size() as usize != n || comm.rank() as usize != call.member {
        return Err(format!(
            "the MPI group over mesh dimensions {:?} has {} ranks with this one at {}, the mesh says {n} at {}",
            call.mesh_dims,
            comm.size(),
            comm.rank(),
            call.member
        ));
    }
    let numel: usize = call.src_shape.iter().product();
    // SAFETY: `start`'s contract: `src` holds `numel` f32 until the wait.
    let src = unsafe { std::slice::from_raw_parts(call.src, numel) };
    let mut all = vec![0f32; numel * n];
    if call.round_bf16 {
        all_gather_bf16(comm, src, &mut all)?;
    } else {
        comm.all_gather_into(src, &mut all[..]);
    }
    let members: Vec<*const f32> = (0..n).map(|i| all[i * numel..].as_ptr()).collect();
    // SAFETY: every member pointer covers `numel` elements of `all`; `dst` is valid per `start`.
    unsafe { combine(call, &members) };
    Ok(())
}

/// Every member's bf16 operand into `all`, moving 2 bytes per element: each f32 slot's high
/// half, which is the whole bf16 value (every op producing bf16 rounds to it, leaving the low
/// half zero). An operand with a low half set is not bf16: the rank still takes part in the
/// gather (so the others are not left waiting in it), then fails instead of using the result.
fn all_gather_bf16(comm: &SimpleCommunicator, src: &[f32], all: &mut [f32]) -> Result<(), String> {
    let halves: Vec<u16> = src.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    let mut gathered = vec![0u16; all.len()];
    comm.all_gather_into(&halves[..], &mut gathered[..]);
    if let Some(at) = src.iter().position(|x| x.to_bits() & 0xffff != 0) {
        return Err(format!(
            "a bf16 collective's operand holds {} at element {at}, which is not a bf16 value",
            src[at]
        ));
    }
    for (slot, half) in all.iter_mut().zip(gathered) {
        *slot = f32::from_bits(u32::from(half) << 16);
    }
    Ok(())
}

fn gather_bytes(world: &SimpleCommunicator, bytes: &[u8]) -> Vec<Vec<u8>> {
    let n = world.size() as usize;
    let mut lengths = vec![0 as Count; n];
    world.all_gather_into(&(bytes.len() as Count), &mut lengths[..]);
    let displs: Vec<Count> = lengths
        .iter()
        .scan(0, |at, &l| {
            let d = *at;
            *at += l;
            Some(d)
        })
        .collect();
    let total: usize = lengths.iter().map(|&l| l as usize).sum();
    if total == 0 {
        // Nothing to move (MPI refuses a gather into an empty buffer).
        return vec![Vec::new(); n];
    }
    let mut all = vec![0u8; total];
    {
        let mut partition = PartitionMut::new(&mut all[..], &lengths[..], &displs[..]);
        world.all_gather_varcount_into(bytes, &mut partition);
    }
    lengths
        .iter()
        .zip(&displs)
        .map(|(&l, &d)| all[d as usize..(d + l) as usize].to_vec())
        .collect()
}

/// An executor's communicator in an MPI job: collectives run on the MPI thread in start order.
pub struct MpiComm {
    world: &'static MpiWorld,
    /// Started collectives by id: sequence number, description, and where the result comes.
    pending: Mutex<HashMap<usize, Pending>>,
    /// Collectives started so far: the sequence number of the next.
    started: Mutex<usize>,
    timeout: Duration,
    flight_dir: std::path::PathBuf,
    /// The last `HISTORY` collectives: sequence, what, when started and finished.
    history: Mutex<VecDeque<Record>>,
    epoch: Instant,
}

type Pending = (usize, String, Receiver<Result<(), String>>);

/// How many collectives the flight record keeps.
const HISTORY: usize = 256;

struct Record {
    sequence: usize,
    what: String,
    started: Duration,
    finished: Option<Duration>,
}

impl MpiComm {
    /// Writes the flight record; returns where.
    fn dump_history(&self) -> Result<std::path::PathBuf, std::io::Error> {
        let path = self.flight_dir.join(format!(
            "graphtrain-rank{}-collectives.txt",
            self.world.rank
        ));
        let mut text = format!(
            "rank {} of {}: its last collectives (seconds since its communicator started)\n",
            self.world.rank, self.world.size
        );
        for r in self.history.lock().expect("not poisoned").iter() {
            let finished = r.finished.map_or("not finished".to_string(), |t| {
                format!("finished {:.3}", t.as_secs_f64())
            });
            text.push_str(&format!(
                "#{} {}: started {:.3}, {finished}\n",
                r.sequence,
                r.what,
                r.started.as_secs_f64()
            ));
        }
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    unsafe fn start(&self, call: CollectiveCall) -> Result<(), RuntimeError> {
        let (done, result) = channel();
        let mut started = self.started.lock().expect("not poisoned");
        let what = format!("{:?} over ranks {:?}", call.collective, call.group);
        {
            let mut history = self.history.lock().expect("not poisoned");
            if history.len() == HISTORY {
                history.pop_front();
            }
            history.push_back(Record {
                sequence: *started,
                what: what.clone(),
                started: self.epoch.elapsed(),
                finished: None,
            });
        }
        self.pending
            .lock()
            .expect("not poisoned")
            .insert(call.id, (*started, what, result));
        *started += 1;
        self.world.post(Request::Collective { call, done })
    }

    fn wait(&self, id: usize) -> Result<(), RuntimeError> {
        let (sequence, what, result) = self
            .pending
            .lock()
            .expect("not poisoned")
            .remove(&id)
            .ok_or_else(|| {
                RuntimeError::Input(format!("a wait for collective {id}, which has not started"))
            })?;
        let outcome = result.recv_timeout(self.timeout);
        if let Ok(Ok(())) = outcome {
            let now = self.epoch.elapsed();
            let mut history = self.history.lock().expect("not poisoned");
            if let Some(r) = history.iter_mut().rev().find(|r| r.sequence == sequence) {
                r.finished = Some(now);
            }
        }
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RuntimeError::Input(format!(
                "collective #{sequence} ({what}) failed: {e}"
            ))),
            Err(RecvTimeoutError::Timeout) => {
                let record = match self.dump_history() {
                    Ok(path) => format!("its last collectives are in {}", path.display()),
                    Err(e) => format!("its last collectives could not be written: {e}"),
                };
                Err(RuntimeError::Input(format!(
                    "collective #{sequence} ({what}) did not finish within {:.0} s: another member is stuck or dead (GRAPHTRAIN_COLLECTIVE_TIMEOUT_S sets the limit); {record}",
                    self.timeout.as_secs_f64()
                )))
            }
            Err(RecvTimeoutError::Disconnected) => Err(RuntimeError::Input(format!(
                "the MPI thread stopped during collective #{sequence} ({what})"
            ))),
        }
    }
}
