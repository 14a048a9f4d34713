//! How an executor reaches the other ranks of its run. Every executor is given a `Communicator`
//! when it loads; it runs a Program's `CollectiveStart` and `Wait` steps through it.
//!
//! - `SingleRank`: a run of one rank. Collectives over groups of one (a graph whose mesh has
//!   size 1) are copies; a graph for more ranks is refused when the executor loads.
//! - `FakeRank`: one rank of a mesh, run alone, for measuring one rank's compute and memory on
//!   meshes far larger than the machine: each collective combines this rank's own operand in
//!   place of every member's, so shapes, copies and sums are a real rank's and no data moves;
//!   the values are no real run's.
//! - `ThreadWorld::communicators`: ranks as threads of one process (`ranks.rs` runs them), each
//!   with a communication thread (the CPU's second stream). A start posts its operand's address
//!   to the collective's meeting and queues the collective for the communication thread, then
//!   returns: compute goes on. The communication thread runs its rank's collectives in start
//!   order: it waits until every member has posted, computes its rank's result from every
//!   member's operand, read in group order, into the handle's bytes, then waits until every
//!   member has read them all, so that no operand is overwritten while another rank still reads
//!   it. A wait blocks until its collective is done. Sums run over members in group order
//!   whatever the rank, so every member gets the same bits and runs repeat bit for bit. Nothing
//!   spins: idle threads sleep on condition variables.
//!
//! Ranks match collectives by order: every rank runs the same Program, so the k-th collective a
//! rank starts is the k-th of every member of its group, and each communication thread, taking
//! its rank's collectives in order, reaches it after all earlier ones have completed.
//!
//! A `Link` per mesh dimension emulates a network on the threads engine: once a collective's
//! data has met, its communication thread holds it for the time the link would take (latency
//! plus the bytes a rank sends under a ring algorithm over the bandwidth) before the wait may
//! return. Compute goes on meanwhile, so a collective started early enough costs nothing: what
//! overlap passes are measured with on one machine, whose shared memory is far faster than
//! any network.
//!
//! Failures stop the whole world: a rank whose step fails calls `abort`, and every rank blocked
//! in a wait (now or later) returns an error naming the failed rank instead of waiting forever.

use crate::RuntimeError;
use graphtrain_ir::{Collective, Graph, Reduce, ValueId};
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One collective as an executor hands it over: what to compute, over which ranks, from where
/// to where. Addresses are raw because the operand stays in the executor's arena, where other
/// ranks read it in place.
#[derive(Clone, Debug)]
pub struct CollectiveCall {
    /// Names the collective between its start and its wait (the handle's value id).
    pub id: usize,
    pub collective: Collective,
    /// The mesh dimensions the group spans (ranks that differ only along them).
    pub mesh_dims: Vec<usize>,
    /// The group's ranks, in group order (`graphtrain_ir::Mesh::group`).
    pub group: Vec<usize>,
    /// This rank's position in `group`.
    pub member: usize,
    /// This rank's operand: `src_shape.iter().product()` contiguous f32.
    pub src: *const f32,
    pub src_shape: Vec<usize>,
    /// Where this rank's result goes: `dst_len` contiguous f32.
    pub dst: *mut f32,
    pub dst_len: usize,
    /// The values are bf16 (held in f32 slots, low 16 bits zero): they travel as 2 bytes each
    /// (`wire_bytes`), and a sum is rounded to bf16 once every member is in.
    pub round_bf16: bool,
}

impl CollectiveCall {
    /// The call of `collective` over `mesh_dims` of `g`'s mesh, for rank `rank`, from value
    /// `src` (at address `src.1`) into the bytes of `handle` (at `handle.1`).
    pub fn new(
        g: &Graph,
        rank: usize,
        collective: Collective,
        mesh_dims: &[usize],
        src: (ValueId, *const f32),
        handle: (ValueId, *mut f32),
    ) -> Result<CollectiveCall, RuntimeError> {
        let mesh = g.mesh.as_ref().ok_or_else(|| {
            RuntimeError::Lower("a collective in a graph without a mesh".to_string())
        })?;
        if rank >= mesh.world_size() {
            return Err(RuntimeError::Input(format!(
                "rank {rank} is outside mesh {mesh} ({} ranks)",
                mesh.world_size()
            )));
        }
        Ok(CollectiveCall {
            id: handle.0.index(),
            collective,
            mesh_dims: mesh_dims.to_vec(),
            group: mesh.group(rank, mesh_dims),
            member: mesh.group_index(rank, mesh_dims),
            src: src.1,
            src_shape: g.ty(src.0).shape.clone(),
            dst: handle.1,
            dst_len: g.ty(handle.0).numel(),
            round_bf16: g.ty(handle.0).dtype == graphtrain_ir::DType::BF16,
        })
    }

    /// Bytes one element takes on the wire: 2 for bf16 (its f32 slot's high half, which holds
    /// all of it), else 4. What a network moves, what MPI sends and what a `Link` charges.
    pub fn wire_bytes(&self) -> usize {
        if self.round_bf16 {
            2
        } else {
            4
        }
    }
}

/// This rank's place in its run, and its collectives.
pub trait Communicator: Send {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// How many ranks the run has.
    fn world_size(&self) -> usize;
    /// Starts `call`.
    ///
    /// # Safety
    /// `call.src` must point to its `src_shape` elements and `call.dst` to `dst_len` elements,
    /// both valid until `wait(call.id)` returns; the caller must not write `src` nor touch
    /// `dst` meanwhile.
    unsafe fn start(&self, call: CollectiveCall) -> Result<(), RuntimeError>;
    /// Returns once the collective started as `id` has its result in its `dst`.
    fn wait(&self, id: usize) -> Result<(), RuntimeError>;
    /// Tells every other rank that this one failed with `why`: their waits return errors.
    /// Returns whether this was the run's first failure (not one another rank's caused).
    fn abort(&self, _why: &str) -> bool {
        true
    }
    /// Time spent blocked in waits, for other ranks or for the collective to finish, since the
    /// last call; resets it.
    fn take_blocked(&self) -> Duration {
        Duration::ZERO
    }
    /// The part of `take_blocked`'s time spent before every member had started the collective
    /// (waiting for peers, not for the transfer), since the last call; resets it. Zero where
    /// the communicator cannot tell (MPI).
    fn take_blocked_for_peers(&self) -> Duration {
        Duration::ZERO
    }
    /// Starts (`on`) or stops keeping a `Transfer` for every collective this rank completes,
    /// for a timeline's communication lane. A communicator that cannot tell when a transfer
    /// ran keeps none.
    fn record_transfers(&self, _on: bool) {}
    /// The transfers kept since recording started or since the last call.
    fn take_transfers(&self) -> Vec<Transfer> {
        Vec::new()
    }
}

/// When one collective's communication ran on this rank: from the moment every member had
/// started it (its data could move) until its result was in place, link time included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The collective's id (its handle's value id).
    pub id: usize,
    pub met: Instant,
    pub done: Instant,
}

/// The communicator of a run with one rank: a collective over a group of one is a copy, done
/// at its start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    unsafe fn start(&self, call: CollectiveCall) -> Result<(), RuntimeError> {
        if call.group != [0] || call.member != 0 {
            return Err(RuntimeError::Input(format!(
                "a collective over ranks {:?} in a run of one rank",
                call.group
            )));
        }
        combine(&call, &[call.src]);
        Ok(())
    }

    fn wait(&self, _id: usize) -> Result<(), RuntimeError> {
        Ok(())
    }
}

/// One rank of a world of `world` ranks, run alone (see the module docs): every other member of
/// a collective is stood in for by this rank's own operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FakeRank {
    pub rank: usize,
    pub world: usize,
}

impl Communicator for FakeRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    unsafe fn start(&self, call: CollectiveCall) -> Result<(), RuntimeError> {
        combine(&call, &vec![call.src; call.group.len()]);
        Ok(())
    }

    fn wait(&self, _id: usize) -> Result<(), RuntimeError> {
        Ok(())
    }
}

// SAFETY: the raw pointers of a pending call are only dereferenced under `start`'s contract.
unsafe impl Send for CollectiveCall {}

/// The shared state of ranks that run as threads of one process.
pub struct ThreadWorld {
    world_size: usize,
    state: Mutex<WorldState>,
    changed: Condvar,
}

#[derive(Default)]
struct WorldState {
    /// Collectives some member has started and not every member has finished, by (the
    /// sequence number of the collective on its members, the group's first rank).
    open: HashMap<MeetingKey, Meeting>,
    /// Set by the first rank that fails.
    failed: Option<String>,
}

/// (The collective's sequence number on its members, its group's first rank.)
type MeetingKey = (u64, usize);

struct Meeting {
    /// Each member's operand, once it has started.
    posted: Vec<Option<SendPtr>>,
    /// Members that have read every operand.
    finished: usize,
}

#[derive(Clone, Copy)]
struct SendPtr(*const f32);
// SAFETY: only an address; the memory it points to is kept valid by `start`'s contract until
// every member has finished reading (the meeting's second barrier).
unsafe impl Send for SendPtr {}

/// An emulated network link: what a collective over a mesh dimension costs beyond the copy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes per second each rank sends.
    pub bytes_per_s: f64,
    /// Per collective.
    pub latency: Duration,
}

impl Link {
    /// Reads `GBPS:LATENCY_US` (`10:5` is 10 GB/s with 5 µs per collective).
    pub fn parse(s: &str) -> Result<Link, String> {
        let (gbps, us) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: a link is GBPS:LATENCY_US, as in 10:5"))?;
        let gbps: f64 = gbps
            .trim()
            .parse()
            .ok()
            .filter(|g: &f64| g.is_finite() && *g > 0.0)
            .ok_or_else(|| format!("`{s}`: the bandwidth must be a positive number of GB/s"))?;
        let us: f64 = us
            .trim()
            .parse()
            .ok()
            .filter(|u: &f64| u.is_finite() && *u >= 0.0)
            .ok_or_else(|| format!("`{s}`: the latency must be a number of microseconds >= 0"))?;
        Ok(Link {
            bytes_per_s: gbps * 1e9,
            latency: Duration::from_secs_f64(us * 1e-6),
        })
    }

    /// The time `call` takes on this link: its latency and what one member sends under a ring
    /// algorithm ((n-1)/n of the gathered or scattered tensor; twice that for an all-reduce),
    /// at the call's wire bytes per element (bf16 moves half of f32's).
    pub fn time(&self, call: &CollectiveCall) -> Duration {
        let n = call.group.len() as f64;
        let element = call.wire_bytes() as f64;
        let src_bytes = call.src_shape.iter().product::<usize>() as f64 * element;
        let dst_bytes = call.dst_len as f64 * element;
        let ring = (n - 1.0) / n;
        let sent = match call.collective {
            Collective::AllGather { .. } => ring * dst_bytes,
            Collective::ReduceScatter { .. } | Collective::AllToAll { .. } => ring * src_bytes,
            Collective::AllReduce { .. } => 2.0 * ring * src_bytes,
            Collective::Broadcast { .. } => src_bytes,
        };
        self.latency + Duration::from_secs_f64(sent / self.bytes_per_s)
    }
}

impl ThreadWorld {
    /// One communicator per rank of a world of `world_size` threads, each with its
    /// communication thread.
    pub fn communicators(world_size: usize) -> Vec<ThreadComm> {
        Self::communicators_over(world_size, Vec::new())
    }

    /// As `communicators`, with an emulated link per mesh dimension (`links[d]`; none: shared
    /// memory only). A collective over several dimensions takes its slowest link's time.
    pub fn communicators_over(world_size: usize, links: Vec<Option<Link>>) -> Vec<ThreadComm> {
        let links = Arc::new(links);
        let world = Arc::new(ThreadWorld {
            world_size,
            state: Mutex::new(WorldState::default()),
            changed: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| {
                let (queue, calls) = channel();
                let completion = Arc::new(Completion::default());
                let (w, c, l) = (world.clone(), completion.clone(), links.clone());
                // Detached: it ends when its queue closes, and a meeting it is in ends when
                // every member arrives or the world fails.
                let _ = std::thread::Builder::new()
                    .name(format!("graphtrain-comm-{rank}"))
                    .spawn(move || communication_thread(&w, rank, calls, &c, &l));
                ThreadComm {
                    world: world.clone(),
                    rank,
                    sequence: Mutex::new(0),
                    queue,
                    completion,
                    blocked: Mutex::new(Duration::ZERO),
                    blocked_for_peers: Mutex::new(Duration::ZERO),
                }
            })
            .collect()
    }

    /// Blocks until `ready` holds for the state or a rank has failed.
    fn wait_until<'a>(
        &'a self,
        mut state: std::sync::MutexGuard<'a, WorldState>,
        ready: impl Fn(&WorldState) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, WorldState>, String> {
        loop {
            if let Some(why) = &state.failed {
                return Err(why.clone());
            }
            if ready(&state) {
                return Ok(state);
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Runs `call`, already posted to its meeting `key`, for its member: waits until every
    /// member has posted, writes this member's result, then waits until every member has read
    /// every operand, so none is overwritten while another rank still reads it.
    /// Returns when every member had posted.
    fn meet(&self, call: &CollectiveCall, key: MeetingKey) -> Result<Instant, String> {
        let (operands, met): (Vec<*const f32>, Instant) = {
            let state = self.wait_until(lock(&self.state), |s| {
                s.open[&key].posted.iter().all(Option::is_some)
            })?;
            let met = Instant::now();
            let operands = state.open[&key]
                .posted
                .iter()
                .map(|p| p.expect("every member posted").0)
                .collect();
            (operands, met)
        };
        // SAFETY: every member's operand stays valid and unchanged until every member has
        // finished (below), and `dst` is this rank's own, per `start`'s contract.
        unsafe { combine(call, &operands) };
        let mut state = lock(&self.state);
        let meeting = state
            .open
            .get_mut(&key)
            .expect("meeting open until all finish");
        meeting.finished += 1;
        if meeting.finished == call.group.len() {
            state.open.remove(&key);
            self.changed.notify_all();
        } else {
            drop(self.wait_until(state, |s| !s.open.contains_key(&key))?);
        }
        Ok(met)
    }
}

/// Runs a rank's collectives in the order they were started, while its compute goes on.
fn communication_thread(
    world: &ThreadWorld,
    rank: usize,
    calls: Receiver<(CollectiveCall, MeetingKey)>,
    completion: &Completion,
    links: &[Option<Link>],
) {
    for (call, key) in calls {
        let result = world.meet(&call, key);
        let emulated = call
            .mesh_dims
            .iter()
            .filter_map(|&d| links.get(d).copied().flatten())
            .map(|link| link.time(&call))
            .max();
        if let (Ok(_), Some(time)) = (&result, emulated) {
            std::thread::sleep(time);
        }
        let mut state = lock(&completion.state);
        state.pending.remove(&call.id);
        match result {
            Ok(met) => {
                state.finished.insert(call.id, met);
                if state.recording {
                    state.transfers.push(Transfer {
                        id: call.id,
                        met,
                        done: Instant::now(),
                    });
                }
            }
            Err(why) => {
                state.failed.get_or_insert(format!("rank {rank}: {why}"));
            }
        }
        drop(state);
        completion.changed.notify_all();
    }
}

/// What a rank's communication thread has done, for its waits.
#[derive(Default)]
struct Completion {
    state: Mutex<CompletionState>,
    changed: Condvar,
}

#[derive(Default)]
struct CompletionState {
    /// Started and not yet completed, by id.
    pending: HashSet<usize>,
    /// Completed and not yet waited for, with when every member had started it.
    finished: HashMap<usize, Instant>,
    /// Why the communication thread could not complete a collective.
    failed: Option<String>,
    /// Whether to keep `transfers` (a timeline is being recorded).
    recording: bool,
    transfers: Vec<Transfer>,
}

/// One rank's end of a `ThreadWorld`: its collectives run on its communication thread, in the
/// order they were started, so a start returns at once and compute goes on until the wait.
pub struct ThreadComm {
    world: Arc<ThreadWorld>,
    rank: usize,
    /// Collectives this rank has started, ever: the next one's sequence number.
    sequence: Mutex<u64>,
    /// The communication thread's queue.
    queue: Sender<(CollectiveCall, MeetingKey)>,
    completion: Arc<Completion>,
    blocked: Mutex<Duration>,
    blocked_for_peers: Mutex<Duration>,
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.world_size
    }

    unsafe fn start(&self, call: CollectiveCall) -> Result<(), RuntimeError> {
        let me = member_index(&call, self.rank)?;
        let key = {
            let mut seq = lock(&self.sequence);
            *seq += 1;
            (*seq, call.group[0])
        };
        {
            let mut state = lock(&self.world.state);
            if let Some(why) = &state.failed {
                return Err(RuntimeError::Backend(why.clone()));
            }
            let n = call.group.len();
            let meeting = state.open.entry(key).or_insert_with(|| Meeting {
                posted: vec![None; n],
                finished: 0,
            });
            meeting.posted[me] = Some(SendPtr(call.src));
        }
        self.world.changed.notify_all();
        lock(&self.completion.state).pending.insert(call.id);
        let id = call.id;
        self.queue.send((call, key)).map_err(|_| {
            RuntimeError::Backend(format!(
                "rank {}: the communication thread has stopped (collective %{id})",
                self.rank
            ))
        })
    }

    fn wait(&self, id: usize) -> Result<(), RuntimeError> {
        let t0 = Instant::now();
        let mut state = lock(&self.completion.state);
        let met = loop {
            if let Some(met) = state.finished.remove(&id) {
                break met;
            }
            if let Some(why) = &state.failed {
                return Err(RuntimeError::Backend(why.clone()));
            }
            if !state.pending.contains(&id) {
                return Err(not_started(id));
            }
            state = self
                .completion
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        };
        drop(state);
        let blocked = t0.elapsed();
        *lock(&self.blocked) += blocked;
        // Until every member had started it, this rank waited for peers; after, for the data.
        *lock(&self.blocked_for_peers) += met.saturating_duration_since(t0).min(blocked);
        Ok(())
    }

    fn abort(&self, why: &str) -> bool {
        let mut state = lock(&self.world.state);
        let first = state.failed.is_none();
        if first {
            state.failed = Some(format!("rank {} failed: {why}", self.rank));
        }
        drop(state);
        self.world.changed.notify_all();
        first
    }

    fn take_blocked_for_peers(&self) -> Duration {
        std::mem::take(&mut *lock(&self.blocked_for_peers))
    }

    fn take_blocked(&self) -> Duration {
        std::mem::take(&mut *lock(&self.blocked))
    }

    fn record_transfers(&self, on: bool) {
        let mut state = lock(&self.completion.state);
        state.recording = on;
        if !on {
            state.transfers.clear();
        }
    }

    fn take_transfers(&self) -> Vec<Transfer> {
        std::mem::take(&mut lock(&self.completion.state).transfers)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind: keep going.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn not_started(id: usize) -> RuntimeError {
    RuntimeError::Backend(format!(
        "a wait for collective %{id}, which this rank has not started"
    ))
}

fn member_index(call: &CollectiveCall, rank: usize) -> Result<usize, RuntimeError> {
    if call.group.get(call.member) != Some(&rank) {
        return Err(RuntimeError::Backend(format!(
            "rank {rank} starts a collective over ranks {:?} as member {}",
            call.group, call.member
        )));
    }
    Ok(call.member)
}

/// Writes `call`'s result for its rank into `call.dst` from the members' operands
/// (`operands[i]` is member `i`'s, each of `call.src_shape`). The same arithmetic as the
/// reference interpreter's, in f32: sums over members in group order.
///
/// # Safety
/// Every operand must point to `src_shape`'s element count of f32, and `dst` to `dst_len`
/// writable f32 that no operand overlaps.
pub(crate) unsafe fn combine(call: &CollectiveCall, operands: &[*const f32]) {
    let numel: usize = call.src_shape.iter().product();
    let members: Vec<&[f32]> = operands
        .iter()
        .map(|&p| std::slice::from_raw_parts(p, numel))
        .collect();
    let dst = std::slice::from_raw_parts_mut(call.dst, call.dst_len);
    let n = members.len();
    let me = call.member;
    let shape = &call.src_shape;
    // (outer, len along axis, inner) of `shape` around `axis`.
    let split = |axis: usize| {
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        (outer, shape[axis], inner)
    };
    let sum_into = |dst: &mut [f32], at: usize, reduce: Reduce| {
        // dst[i] = reduce over members of member[at + i], members in group order.
        let len = dst.len();
        dst.copy_from_slice(&members[0][at..at + len]);
        for m in &members[1..] {
            for (d, s) in dst.iter_mut().zip(&m[at..at + len]) {
                *d += *s;
            }
        }
        if reduce == Reduce::Avg {
            let n = n as f32;
            for d in dst.iter_mut() {
                *d /= n;
            }
        }
    };
    match call.collective {
        Collective::AllGather { axis } => {
            // Each member's block of `len · inner` per outer index, concatenated in group order.
            let (outer, len, inner) = split(axis);
            let chunk = len * inner;
            for o in 0..outer {
                for (i, m) in members.iter().enumerate() {
                    let at = (o * n + i) * chunk;
                    dst[at..at + chunk].copy_from_slice(&m[o * chunk..(o + 1) * chunk]);
                }
            }
        }
        Collective::ReduceScatter { axis, reduce } => {
            let (outer, len, inner) = split(axis);
            let block = len / n * inner;
            for o in 0..outer {
                let at = o * len * inner + me * block;
                sum_into(&mut dst[o * block..(o + 1) * block], at, reduce);
            }
        }
        Collective::AllReduce { reduce } => sum_into(dst, 0, reduce),
        Collective::AllToAll {
            split_axis,
            concat_axis,
        } => {
            // Block `me` of every member along `split_axis`, concatenated along `concat_axis`.
            let mut part_shape = shape.clone();
            part_shape[split_axis] /= n;
            let parts: Vec<Vec<f32>> = members
                .iter()
                .map(|m| {
                    let (outer, len, inner) = split(split_axis);
                    let block = len / n * inner;
                    let mut v = Vec::with_capacity(outer * block);
                    for o in 0..outer {
                        let at = o * len * inner + me * block;
                        v.extend_from_slice(&m[at..at + block]);
                    }
                    v
                })
                .collect();
            let outer: usize = part_shape[..concat_axis].iter().product();
            let chunk: usize = part_shape[concat_axis..].iter().product();
            for o in 0..outer {
                for (i, p) in parts.iter().enumerate() {
                    let at = (o * n + i) * chunk;
                    dst[at..at + chunk].copy_from_slice(&p[o * chunk..(o + 1) * chunk]);
                }
            }
        }
        Collective::Broadcast { root } => dst.copy_from_slice(&members[root][..call.dst_len]),
    }
    // Sums in f32, then one rounding to the bf16 result (moved values are bf16 already).
    if call.round_bf16 {
        for d in dst.iter_mut() {
            *d = graphtrain_ir::host_tensor::round_bf16(*d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::RecvTimeoutError;

    /// The call `id` of `collective` for `member` of `group` (over mesh dimension 0), from the
    /// 1-D operand `src` into `dst_len` floats at `dst`.
    fn call_of(
        id: usize,
        collective: Collective,
        (group, member): (Vec<usize>, usize),
        src: &[f32],
        (dst, dst_len): (*mut f32, usize),
    ) -> CollectiveCall {
        CollectiveCall {
            id,
            collective,
            mesh_dims: vec![0],
            group,
            member,
            src: src.as_ptr(),
            src_shape: vec![src.len()],
            dst,
            dst_len,
            round_bf16: false,
        }
    }

    /// A collective completes while a member is still computing: rank 1 waits at once, rank 0
    /// calls its wait only after rank 1's has returned. Without a communication thread rank 0
    /// would read the operands only in its wait, and rank 1 would wait for it forever.
    #[test]
    fn a_collective_completes_before_every_member_waits() {
        let comms = ThreadWorld::communicators(2);
        let src = [vec![1.0f32, 2.0, 3.0, 4.0], vec![10.0, 20.0, 30.0, 40.0]];
        let mut dst = [vec![0.0f32; 2], vec![0.0f32; 2]];
        let dst_ptr = [dst[0].as_mut_ptr(), dst[1].as_mut_ptr()];
        let scatter = Collective::ReduceScatter {
            axis: 0,
            reduce: Reduce::Sum,
        };
        let call = |rank: usize| {
            call_of(
                7,
                scatter,
                (vec![0, 1], rank),
                &src[rank],
                (dst_ptr[rank], 2),
            )
        };
        // SAFETY: `src` and `dst` outlive both waits below and are not touched meanwhile.
        unsafe {
            comms[0].start(call(0)).unwrap();
            comms[1].start(call(1)).unwrap();
        }
        let (rank1_done, rank1_waited) = channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                comms[1].wait(7).unwrap();
                rank1_done.send(()).unwrap();
            });
            match rank1_waited.recv_timeout(Duration::from_secs(20)) {
                Ok(()) => {}
                Err(RecvTimeoutError::Timeout) => {
                    // Let rank 1 go before failing, so the scope can end.
                    comms[0].wait(7).unwrap();
                    panic!("rank 1's wait returned only once rank 0 waited too");
                }
                Err(e) => panic!("{e}"),
            }
            comms[0].wait(7).unwrap();
        });
        assert_eq!(dst, [vec![11.0, 22.0], vec![33.0, 44.0]]);
        // Each rank's waits are counted.
        let _ = comms[0].take_blocked();
        assert_eq!(comms[0].take_blocked(), Duration::ZERO, "taking resets");
    }

    /// A fake rank's collectives have the real shapes, built from its own operand alone: its
    /// all-gather repeats its block, its sums count it once per member.
    #[test]
    fn a_fake_rank_stands_in_for_every_member() {
        let fake = FakeRank { rank: 1, world: 4 };
        let src = [1.0f32, 2.0];
        let run = |collective: Collective, dst_len: usize| {
            let mut dst = vec![0.0f32; dst_len];
            let call = call_of(
                0,
                collective,
                (vec![0, 1, 2], 1),
                &src,
                (dst.as_mut_ptr(), dst_len),
            );
            // SAFETY: `src` and `dst` outlive the call, which completes at its start.
            unsafe { fake.start(call).unwrap() };
            fake.wait(0).unwrap();
            dst
        };
        assert_eq!(
            run(Collective::AllGather { axis: 0 }, 6),
            [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
        );
        let sum = Collective::AllReduce {
            reduce: Reduce::Sum,
        };
        assert_eq!(run(sum, 2), [3.0, 6.0]);
        assert_eq!(fake.world_size(), 4);
    }

    /// A link's time is its latency plus a ring's bytes over its bandwidth, and the threads
    /// engine holds a collective at least that long before its wait returns.
    #[test]
    fn an_emulated_link_holds_each_collective_for_its_time() {
        let link = Link::parse("0.001:2000").unwrap();
        assert_eq!(link.bytes_per_s, 1e6);
        let call = |collective: Collective, member: usize, src: &[f32], dst: &mut [f32]| {
            call_of(
                1,
                collective,
                (vec![0, 1], member),
                src,
                (dst.as_mut_ptr(), dst.len()),
            )
        };
        let src = vec![1.0f32; 1000];
        let mut dst = vec![0.0f32; 2000];
        // 2000 gathered f32, half of them sent: 4000 bytes at 1 MB/s, and 2 ms.
        let gather = call(Collective::AllGather { axis: 0 }, 0, &src, &mut dst);
        assert_eq!(link.time(&gather), Duration::from_millis(6));
        let sum = Collective::AllReduce {
            reduce: Reduce::Sum,
        };
        // An all-reduce sends twice a ring's share: 2 x 2000 bytes.
        assert_eq!(
            link.time(&call(sum, 0, &src, &mut dst[..1000])),
            Duration::from_millis(6)
        );
        // bf16 values travel in 2 bytes: the gather sends 2000 bytes.
        let bf16_gather = CollectiveCall {
            round_bf16: true,
            ..gather.clone()
        };
        assert_eq!(link.time(&bf16_gather), Duration::from_millis(4));
        for bad in ["1", "0:5", "-1:5", "1:-5", "x:1"] {
            assert!(Link::parse(bad).is_err(), "{bad}");
        }
        let comms = ThreadWorld::communicators_over(2, vec![Some(link)]);
        let srcs = [vec![1.0f32; 1000], vec![2.0f32; 1000]];
        let mut dsts = [vec![0.0f32; 2000], vec![0.0f32; 2000]];
        let dst_ptrs = [dsts[0].as_mut_ptr(), dsts[1].as_mut_ptr()];
        let t = Instant::now();
        for (rank, comm) in comms.iter().enumerate() {
            let c = call_of(
                1,
                Collective::AllGather { axis: 0 },
                (vec![0, 1], rank),
                &srcs[rank],
                (dst_ptrs[rank], 2000),
            );
            // SAFETY: `srcs` and `dsts` outlive both waits and are not touched meanwhile.
            unsafe { comm.start(c).unwrap() };
        }
        for comm in &comms {
            comm.wait(1).unwrap();
        }
        assert!(t.elapsed() >= Duration::from_millis(6), "{:?}", t.elapsed());
        assert_eq!(dsts[0][..1000], srcs[0][..]);
        assert_eq!(dsts[1][1000..], srcs[1][..]);
    }

    /// A rank that waits before its peer has started counts that time as waiting for peers,
    /// apart from the rest of its blocked time.
    #[test]
    fn time_waiting_for_a_peer_to_start_is_told_apart() {
        let comms = ThreadWorld::communicators(2);
        let srcs = [vec![1.0f32; 4], vec![2.0f32; 4]];
        let mut dsts = [vec![0.0f32; 4], vec![0.0f32; 4]];
        let ptrs = [dsts[0].as_mut_ptr(), dsts[1].as_mut_ptr()];
        let sum = Collective::AllReduce {
            reduce: Reduce::Sum,
        };
        let call = |rank: usize| call_of(3, sum, (vec![0, 1], rank), &srcs[rank], (ptrs[rank], 4));
        std::thread::scope(|s| {
            // SAFETY: `srcs` and `dsts` outlive both waits and are not touched meanwhile.
            unsafe { comms[1].start(call(1)).unwrap() };
            s.spawn(|| comms[1].wait(3).unwrap());
            std::thread::sleep(Duration::from_millis(30));
            unsafe { comms[0].start(call(0)).unwrap() };
            comms[0].wait(3).unwrap();
        });
        let (blocked, for_peers) = (comms[1].take_blocked(), comms[1].take_blocked_for_peers());
        assert!(for_peers >= Duration::from_millis(20), "{for_peers:?}");
        assert!(for_peers <= blocked, "{for_peers:?} of {blocked:?}");
        assert_eq!(dsts[0], vec![3.0; 4]);
    }

    #[test]
    fn a_wait_for_a_collective_never_started_is_an_error() {
        let comms = ThreadWorld::communicators(1);
        let e = comms[0].wait(3).unwrap_err();
        assert!(e.to_string().contains("has not started"), "{e}");
    }
}
