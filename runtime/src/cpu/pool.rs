//! A persistent fork-join pool for the cpu backend: `run(n, f)` calls `f(0..n)` across the
//! calling thread and the pool's workers and returns when all calls are done.
//!
//! Why our own: a replayed launch list (`replay.rs`) and the GEMM both split work into a handful
//! of tasks per step, a thousand times per training step. Spawning threads per call costs tens
//! of microseconds and cubecl-cpu's dispatcher hundreds (docs/cubecl-notes.md); a worker that
//! spins briefly on a shared word picks a task up in well under a microsecond.
//!
//! Tasks are claimed, not assigned: the caller claims too, so a worker descheduled by other load
//! delays nothing; the caller simply runs its task as well. Results therefore never depend on
//! which thread ran a task, only on the task index, which keeps every kernel deterministic.
//!
//! Re-entry (a task calling `run`) and concurrent callers (tests on several threads) do not wait
//! for the pool: they run their tasks serially on their own thread.
//!
//! Kernels take the pool of their thread (`Pool::current`): the global one (one worker per core
//! beyond the caller), or on a rank's thread its own share of the cores (`Pool::for_rank`).

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before yielding, and yields before parking. Spinning covers the
/// gap between two launches of a step; parking keeps an idle pool off the cores.
const SPIN_FOR: Duration = Duration::from_micros(50);
const YIELD_FOR: Duration = Duration::from_micros(500);

type Job = *const (dyn Fn(usize) + Sync);

thread_local! {
    /// This thread's pool, where a rank thread chose one (`Pool::use_on_this_thread`).
    static CURRENT: Cell<Option<&'static Pool>> = const { Cell::new(None) };
}

struct Shared {
    /// `epoch << 32 | tasks << 16 | next`: a worker claims task `next` of the current job with
    /// one compare-and-swap, so a late worker can never claim from a job that has moved on.
    state: AtomicU64,
    /// The job of the current epoch; written before `state` is published (Release) and read
    /// after a successful claim (Acquire).
    job: UnsafeCell<Option<Job>>,
    done: AtomicUsize,
    panicked: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by the thread holding `Pool::caller` while no task of the
// previous job is running (it waited for `done`), and read only by a thread that claimed a task
// of the current epoch, which keeps the job alive until that task reports done.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<Thread>,
    /// Held by the one caller currently running a job.
    caller: Mutex<()>,
}

/// A pointer the tasks of one `run` share, for buffers each task writes at its own elements
/// only; whoever hands one out states which elements each task may write.
#[derive(Clone, Copy)]
pub struct TaskPtr<T>(pub *mut T);
// SAFETY: a `TaskPtr` only carries the address; the disjointness of the tasks' writes is the
// contract of the code that creates it (every creator says why in a SAFETY comment).
unsafe impl<T> Sync for TaskPtr<T> {}
unsafe impl<T> Send for TaskPtr<T> {}

impl<T> TaskPtr<T> {
    /// Element `i` (a method, so closures capture the whole wrapper, not its raw pointer).
    pub fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

fn unpack(s: u64) -> (u64, usize, usize) {
    (
        s >> 32,
        ((s >> 16) & 0xffff) as usize,
        (s & 0xffff) as usize,
    )
}

fn pack(epoch: u64, tasks: usize, next: usize) -> u64 {
    (epoch << 32) | ((tasks as u64) << 16) | next as u64
}

impl Shared {
    /// Claims and runs one task of the current job; false when none is left.
    fn run_one(&self) -> bool {
        let s = self.state.load(Ordering::Acquire);
        let (epoch, tasks, next) = unpack(s);
        if next >= tasks {
            return false;
        }
        if self
            .state
            .compare_exchange(
                s,
                pack(epoch, tasks, next + 1),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return true;
        }
        // SAFETY: see `unsafe impl Sync for Shared`.
        let job = unsafe { (*self.job.get()).expect("a claimed task has a job") };
        // SAFETY: the job outlives every task claimed in its epoch.
        let f = unsafe { &*job };
        if catch_unwind(AssertUnwindSafe(|| f(next))).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.done.fetch_add(1, Ordering::Release);
        true
    }
}

impl Pool {
    fn new(workers: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (0..workers)
            .map(|w| {
                let shared = shared.clone();
                thread::Builder::new()
                    .name(format!("graphtrain-cpu-{w}"))
                    .spawn(move || worker(&shared, w))
                    .expect("cannot spawn a cpu worker thread")
                    .thread()
                    .clone()
            })
            .collect();
        Pool {
            shared,
            workers,
            caller: Mutex::new(()),
        }
    }

    /// The process-wide pool: one worker per core beyond the caller's.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let cores = thread::available_parallelism().map_or(1, |n| n.get());
            Pool::new(cores.saturating_sub(1).min(0xfffe))
        })
    }

    /// The pool this thread's kernels run on: the one `use_on_this_thread` chose (a rank's
    /// share of the cores), else the global pool.
    pub fn current() -> &'static Pool {
        CURRENT.with(Cell::get).unwrap_or_else(Pool::global)
    }

    /// A pool `width` threads wide (the caller and `width - 1` workers) for the thread of rank
    /// `rank`. Made once per (rank, width) and kept for the process, as the global pool is:
    /// runs one after another reuse it, and the ranks of one run never share one. Two runs at
    /// once (tests on several threads) may; the second caller then runs its tasks serially, as
    /// any concurrent caller does.
    pub fn for_rank(rank: usize, width: usize) -> &'static Pool {
        type Pools = Mutex<Vec<((usize, usize), &'static Pool)>>;
        static POOLS: OnceLock<Pools> = OnceLock::new();
        let mut pools = POOLS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let key = (rank, width.max(1));
        if let Some((_, pool)) = pools.iter().find(|(k, _)| *k == key) {
            return pool;
        }
        let pool: &'static Pool = Box::leak(Box::new(Pool::new((key.1 - 1).min(0xfffe))));
        pools.push((key, pool));
        pool
    }

    /// Makes `self` the pool of this thread's kernels (`current`).
    pub fn use_on_this_thread(&'static self) {
        CURRENT.with(|c| c.set(Some(self)));
    }

    /// Threads a job can run on at once (workers plus the caller).
    pub fn width(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the caller and the workers; returns when
    /// all calls have returned. A panic in a task is re-raised here.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 || self.workers.is_empty() {
            (0..tasks).for_each(f);
            return;
        }
        let _guard = match self.caller.try_lock() {
            Ok(guard) => guard,
            // A task panicked under an earlier caller; the pool itself is intact.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let sh = &*self.shared;
        let tasks = tasks.min(0xffff);
        // SAFETY: no task of the previous job is running (its caller waited for `done`), and
        // `f` outlives this call, which waits for every task of this job.
        unsafe {
            *sh.job.get() =
                Some(std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f as *const _));
        }
        sh.done.store(0, Ordering::Relaxed);
        let (epoch, _, _) = unpack(sh.state.load(Ordering::Relaxed));
        sh.state
            .store(pack((epoch + 1) & 0xffff_ffff, tasks, 0), Ordering::SeqCst);
        for (w, t) in self.workers.iter().enumerate().take(tasks - 1) {
            if sh.sleeping[w].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
        while sh.run_one() {}
        while sh.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        // SAFETY: every task has returned; nothing reads the job until the next epoch.
        unsafe { *sh.job.get() = None };
        if sh.panicked.swap(false, Ordering::Relaxed) {
            panic!("a cpu backend task panicked");
        }
    }
}

fn worker(sh: &Shared, w: usize) {
    let mut idle_since = Instant::now();
    loop {
        if sh.run_one() {
            idle_since = Instant::now();
            continue;
        }
        let idle = idle_since.elapsed();
        if idle < SPIN_FOR {
            std::hint::spin_loop();
        } else if idle < YIELD_FOR {
            thread::yield_now();
        } else {
            let seen = sh.state.load(Ordering::SeqCst);
            sh.sleeping[w].store(true, Ordering::SeqCst);
            // A job published after `seen` finds `sleeping` set and unparks us; one published
            // before it is caught by this re-check. A stale unpark only wakes us early.
            if sh.state.load(Ordering::SeqCst) == seen {
                thread::park();
            }
            sh.sleeping[w].store(false, Ordering::SeqCst);
            idle_since = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_task_runs_once_per_job() {
        let pool = Pool::new(3);
        for tasks in [0, 1, 2, 4, 7] {
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn jobs_after_the_workers_park_still_run() {
        let pool = Pool::new(1);
        let sum = AtomicUsize::new(0);
        pool.run(2, &|i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        });
        thread::sleep(Duration::from_millis(5));
        pool.run(2, &|i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn a_nested_run_runs_serially_instead_of_deadlocking() {
        let pool = Pool::new(1);
        let count = AtomicUsize::new(0);
        pool.run(2, &|_| {
            pool.run(3, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn a_panicking_task_is_reported_to_the_caller() {
        let pool = Pool::new(1);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(2, &|i| assert!(i != 1, "boom"))
        }));
        assert!(r.is_err());
        // The pool stays usable.
        let n = AtomicUsize::new(0);
        pool.run(2, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
