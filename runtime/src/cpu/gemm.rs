//! Deterministic multi-threaded f32 GEMM on raw host buffers (std only).
//!
//! Contract:
//! * `C[b] = A[b] @ B[b]`, C contiguous row-major, overwritten.
//! * Every C element is one sequential chain `acc = fma(a[k], b[k], acc)` for k = 0, 1, ...
//!   starting from 0. Cache blocking never changes that chain: for every k block after the
//!   first, the kernel reloads the partial C tile into its accumulators and keeps going.
//!   Threads only split batch x m x n, never one element's k chain (a phased call, below,
//!   runs a row range's k blocks on any thread, but one after the other, from the C that
//!   the previous block left). So the bits depend neither on the thread
//!   count, nor on the block sizes, nor on the scheduling, and the AVX2 and AVX-512 paths
//!   give identical bits (both are the same fused chain). The portable fallback uses fused
//!   multiply-add only where the target has it in hardware, so it may differ in rounding.
//! * Kernel: AVX-512F 12x32 if present, else AVX2+FMA 6x16, else portable 4x8, detected once per
//!   process; a caller may ask for a narrower one (`GemmKernel`, for benchmarks).
//! * Work is split into tasks that the threads claim as they go. With one batch, tasks split
//!   only m (or only n) when the other operand is small enough: each thread then packs that
//!   operand once per call and reuses it for all its tasks, so a core that the host slows down
//!   for a while takes fewer tasks instead of holding the other one up (see [`split`]).
//! * When a call would give each thread fewer than [`MIN_TASKS_PER_THREAD`] tasks that way (the
//!   weight gradients, with k = 2048), or would split n over a row-major A that every task then
//!   reads whole (1024^3), its tasks become one k block of one row range each
//!   ([`Reuse::Phased`]): a range's next k block waits for its previous one, so the chain
//!   order holds whichever thread runs which block.
//! * Each thread keeps its packing buffer between calls (grown to the largest call it ran), to
//!   avoid page faults on every call and to keep packed panels in the core that packed them.

use super::lines::LineBuffer;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// One operand's layout: element (row r, col c) of matrix b (batch index) lives at
/// ptr + b*batch_stride + r*row_stride + c*col_stride  (strides in elements; either of
/// row_stride/col_stride may be 1, i.e. the operand may be transposed).
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub row_stride: usize,
    pub col_stride: usize,
    pub batch_stride: usize,
}

/// Minimum flops a spawned thread must get; below this, spawning costs more than it saves.
const MIN_FLOPS_PER_THREAD: usize = 1 << 22;

/// Tasks per thread when tasks split both m and n. Every such task packs its own A rows and B
/// columns, so each extra task repeats packing; two per thread cost up to 14% on `peer`'s
/// shapes, most on the weight gradients (k = 2048), measured A/B in one process.
const TASKS_PER_THREAD: usize = 1;

/// Tasks per thread when tasks split only m (or only n), so that every task needs all of B (or
/// all of A), which each worker packs once per call and keeps ([`Reuse`]). Extra tasks then
/// repeat no packing, and the cores claim them as they go: on this VM one vCPU often gets less
/// of the host than the other for a while, and with one task each, the faster core waited
/// for the slower one (`Pool::run` was 5-8% of a `peer` step under `perf`). The caller still
/// waits for the other thread's last task: with 4 tasks per thread that was 6-7% of these
/// calls' time, with 8 it is 3-4%, and the step got 2-5% faster (paired, in one process).
const REUSE_TASKS_PER_THREAD: usize = 8;

/// Fewest rows (or columns) per task when a worker reuses its packed operand. Each such task
/// streams the whole reused operand through the cache; with thinner tasks the weight gradients
/// (k = 2048) ran at 0.81-0.94x the speed, measured A/B in one process.
const MIN_REUSE_TASK: usize = 128;

/// Largest operand, in floats (1 MiB), that a worker packs in full and keeps for a call. At
/// 2 MiB (the weight gradients, the output head) it no longer stays in L2 between tasks, and
/// those calls ran at 0.93-0.98x the speed; with this limit `peer`'s step still gained 2-3%.
const MAX_REUSE_FLOATS: usize = 1 << 18;

/// Fewest tasks per thread that let the faster core take work over from a slower one. A split
/// with fewer goes phased ([`Reuse::Phased`]) where m allows: with one task per thread, one
/// core idled for 13-22% of those calls' time in `peer`'s step (the two finish times,
/// measured per call), and phased calls made the step 3-4% faster (paired, docs/benchmarks.md).
const MIN_TASKS_PER_THREAD: usize = 4;

/// Register-tile panels per row range of a phased call: at most 8 (96 rows of the AVX-512
/// tile), and at least 4, because each task streams its k block of B through the cache once.
const PHASED_PANELS: std::ops::RangeInclusive<usize> = 4..=8;

/// Largest MR*NR over all kernels (edge tiles go through a stack temp of this size).
const MAX_TILE: usize = 12 * 32;

/// C[b] = A[b] @ B[b] for b in 0..batch, C contiguous row-major (m x n, batch stride m*n), overwritten (not accumulated).
/// A is m x k, B is k x n. batch_stride 0 on B means B is shared by all batches.
/// `threads` >= 1: how many threads of the cpu pool (`pool.rs`, the caller included) may share the tasks.
///
/// # Safety
/// `a`, `b` must be valid for the reads described by their layouts for all
/// `b < batch, r, c` in range; `c` must be valid for `batch*m*n` writes; `c` must not
/// overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
    threads: usize,
) {
    // SAFETY: forwarded contract.
    unsafe { sgemm_with(GemmKernel::Widest, batch, m, n, k, a, la, b, lb, c, threads) }
}

/// [`sgemm`] on the kernel `kernel` names (the widest the cpu has where it names one the cpu
/// lacks). Every kernel gives the same bits: one FMA chain per output element, k in order.
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_with(
    kernel: GemmKernel,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
    threads: usize,
) {
    // SAFETY: forwarded contract.
    unsafe { sgemm_path(kernel.path(), batch, m, n, k, a, la, b, lb, c, threads) }
}

/// Which register-tiled kernel the GEMM runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmKernel {
    /// The widest the cpu has: AVX-512, else AVX2 with FMA, else portable; for bf16 matmuls
    /// AMX tiles where the cpu has them, else `vdpbf16ps` where it has AVX512_BF16.
    #[default]
    Widest,
    /// The widest without AMX tiles (bf16 matmuls on `vdpbf16ps`): for measuring the AVX-512
    /// kernels on an AMX cpu.
    Avx512,
    /// The AVX2 kernel where the cpu has AVX2 and FMA, else the widest: for measuring it on an
    /// AVX-512 cpu.
    Avx2,
    /// The portable kernel.
    Portable,
}

impl GemmKernel {
    /// The kernel a setting names (`widest`, `avx512`, `avx2` or `scalar`; the CLI's
    /// `--tuning gemm=` and `GRAPHTRAIN_GEMM_KERNEL`), `None` for any other word.
    pub fn from_setting(value: &str) -> Option<GemmKernel> {
        match value {
            "widest" => Some(GemmKernel::Widest),
            "avx512" => Some(GemmKernel::Avx512),
            "avx2" => Some(GemmKernel::Avx2),
            "scalar" => Some(GemmKernel::Portable),
            _ => None,
        }
    }

    /// The words `from_setting` takes, for error messages.
    pub const SETTINGS: &'static str = "widest, avx512, avx2 or scalar";

    fn path(self) -> Path {
        let widest = widest_path();
        match self {
            GemmKernel::Widest | GemmKernel::Avx512 => widest,
            GemmKernel::Portable => Path::Scalar,
            #[cfg(target_arch = "x86_64")]
            GemmKernel::Avx2 if widest != Path::Scalar => Path::Avx2,
            GemmKernel::Avx2 => widest,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The widest kernel this cpu runs, detected once per process.
fn widest_path() -> Path {
    // 0 = unknown; cached so every call on this machine takes the same path.
    static CACHE: AtomicU8 = AtomicU8::new(0);
    let code = CACHE.load(Ordering::Relaxed);
    #[cfg(target_arch = "x86_64")]
    {
        let code = if code != 0 {
            code
        } else {
            let c = if is_x86_feature_detected!("avx512f") {
                3
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                2
            } else {
                1
            };
            CACHE.store(c, Ordering::Relaxed);
            c
        };
        match code {
            3 => Path::Avx512,
            2 => Path::Avx2,
            _ => Path::Scalar,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = code;
        Path::Scalar
    }
}

/// Shared, read-only description of one call; workers index into it by task number.
struct Ctx {
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    a_bs: usize,
    b: *const f32,
    b_rs: usize,
    b_cs: usize,
    b_bs: usize,
    c: *mut f32,
    mr: usize,
    nr: usize,
    /// Register-tile panels along m and n, and how many task ranges each is split into.
    pm: usize,
    pn: usize,
    sm: usize,
    sn: usize,
    /// Offset (floats) of the packed-B area inside a worker's buffer.
    b_off: usize,
    reuse: Reuse,
    /// With [`Reuse::A`]: floats per k block of the packed A (every row of A, MR-padded).
    a_blk: usize,
    /// With [`Reuse::Phased`]: per row range, how many k blocks are done.
    blocks_done: Vec<AtomicUsize>,
}

/// Which operand every worker packs in full, once per call, and keeps for all its tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reuse {
    /// Each task packs its own B columns (and its A rows, when A is column-major).
    None,
    /// Tasks split m only, so each needs all of B.
    B,
    /// Tasks split n only, so each needs all of A.
    A,
    /// Tasks are (k block, row range) pairs, `sm` ranges over all of n, claimed k block after
    /// k block ([`run_phased`]). Each worker packs a k block of B when it first needs it.
    Phased,
}

/// How one call is cut into tasks: `sm` x `sn` per batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    sm: usize,
    sn: usize,
    reuse: Reuse,
}

// SAFETY: workers write disjoint C tiles (tasks partition batch x m x n; a phased call's tasks
// on one row range write it one after the other, ordered through `blocks_done`) and only read
// A/B.
unsafe impl Sync for Ctx {}

/// Runs task `t` in the worker's buffer; `packed` says what this worker has packed so far in
/// this call: 0 nothing; with [`Reuse::A`] or [`Reuse::B`], 1 the reused operand; with
/// [`Reuse::Phased`], `kb + 1` for B's k block `kb`.
type TaskFn = unsafe fn(&Ctx, usize, *mut f32, &mut usize);

/// Blocking of one kernel, as plain values for the (non-generic) planner.
struct Params {
    mr: usize,
    nr: usize,
    mc: usize,
    nc: usize,
    kc: usize,
    kcp: usize,
    task: TaskFn,
}

fn params<K: Kernel>(task: TaskFn) -> Params {
    Params {
        mr: K::MR,
        nr: K::NR,
        mc: K::MC,
        nc: K::NC,
        kc: K::KC,
        kcp: K::KCP,
        task,
    }
}

impl Params {
    /// Floats per k block of A packed whole for [`Reuse::A`] (every row, MR-padded).
    fn a_block_len(&self, m: usize) -> usize {
        m.next_multiple_of(self.mr) * self.kcp
    }

    /// Floats of A packed whole, every k block, for [`Reuse::A`].
    fn a_whole_len(&self, m: usize, k: usize) -> usize {
        self.a_block_len(m) * k.div_ceil(self.kc)
    }

    /// Floats of B packed whole for [`Reuse::B`].
    fn b_whole_len(&self, n: usize, k: usize) -> usize {
        n.next_multiple_of(self.nr) * k
    }
}

fn path_params(path: Path) -> Params {
    match path {
        Path::Scalar => params::<Scalar>(task_scalar),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => params::<x86::Avx2>(x86::task_avx2),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => params::<x86::Avx512>(x86::task_avx512),
    }
}

/// # Safety
/// Same as [`sgemm`]; `path` must be supported by this CPU.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_path(
    path: Path,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
    threads: usize,
) {
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // SAFETY: c valid for batch*m*n writes.
        unsafe { std::ptr::write_bytes(c, 0, batch * m * n) };
        return;
    }
    // With B shared and A's batches laid out as consecutive rows, the batch is just a taller
    // A: one big GEMM packs B once instead of once per batch.
    let (batch, m, a_bs) =
        if batch > 1 && lb.batch_stride == 0 && la.batch_stride == m * la.row_stride {
            (1, batch * m, 0)
        } else {
            (batch, m, la.batch_stride)
        };
    let p = path_params(path);
    let threads = threads.max(1);
    let flops = 2usize
        .saturating_mul(batch)
        .saturating_mul(m)
        .saturating_mul(n)
        .saturating_mul(k);
    let threads = threads.min((flops / MIN_FLOPS_PER_THREAD).max(1));

    let (pm, pn) = (m.div_ceil(p.mr), n.div_ceil(p.nr));
    let a_rows = la.col_stride == 1;
    let Split { sm, sn, reuse } = split(&p, batch, m, n, k, a_rows, threads);
    let phased = reuse == Reuse::Phased;
    let ntasks = if phased {
        k.div_ceil(p.kc) * sm
    } else {
        batch * sm * sn
    };
    let threads = threads.min(ntasks);
    let (mt, nt) = (pm.div_ceil(sm) * p.mr, pn.div_ceil(sn) * p.nr);

    // A block (either panel layout fits in MR*KCP floats per panel), then B block at a
    // 64-byte boundary. A reused operand takes its full packed size instead.
    let a_blk = p.a_block_len(m);
    let a_len = match reuse {
        Reuse::A => p.a_whole_len(m, k),
        _ => p.mc.min(mt) * p.kcp,
    };
    let b_len = match reuse {
        Reuse::B => p.b_whole_len(n, k),
        Reuse::Phased => p.kc.min(k) * pn * p.nr,
        _ => p.kc.min(k) * nt.min(p.nc),
    };
    let b_off = a_len.next_multiple_of(16);
    let buf_len = b_off + b_len;
    let ctx = Ctx {
        m,
        n,
        k,
        a,
        a_rs: la.row_stride,
        a_cs: la.col_stride,
        a_bs,
        b,
        b_rs: lb.row_stride,
        b_cs: lb.col_stride,
        b_bs: lb.batch_stride,
        c,
        mr: p.mr,
        nr: p.nr,
        pm,
        pn,
        sm,
        sn,
        b_off,
        reuse,
        a_blk,
        blocks_done: (0..if phased { sm } else { 0 })
            .map(|_| AtomicUsize::new(0))
            .collect(),
    };

    let next = AtomicUsize::new(0);
    let task = p.task;
    let worker = || {
        with_packing_buffer(buf_len, |bp| {
            let mut packed = 0;
            loop {
                // Claimed in index order: a phased task waits only for lower indices, all
                // claimed already, by tasks that never wait for a higher one.
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= ntasks {
                    break;
                }
                // SAFETY: tasks are disjoint; buffer holds buf_len floats.
                unsafe { task(&ctx, t, bp, &mut packed) };
            }
        })
    };
    if threads == 1 {
        worker();
    } else {
        super::pool::Pool::current().run(threads, &|_| worker());
    }
}

/// Cuts one call into tasks for `threads` threads; `a_rows`: A is row-major, so it is read in
/// place and never packed.
///
/// With one batch, tasks split only the larger of m and n when the other operand, packed in
/// full, fits [`MAX_REUSE_FLOATS`] (row-major A always fits: it is not packed at all): each
/// worker packs it once and the tasks are many and small ([`REUSE_TASKS_PER_THREAD`]).
/// Where that gives fewer than [`MIN_TASKS_PER_THREAD`] tasks per thread, or no operand fits,
/// or the split is over n with row-major A (which every task would read in full: phased,
/// 1024^3 ran 7% faster on two threads, alternated in one process), the call goes phased,
/// when m has rows enough for two ranges per thread. Otherwise
/// (batches, small m, or one thread) it is the least packing per task, mt + nt, among the
/// splits that give one task per thread.
fn split(
    p: &Params,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a_rows: bool,
    threads: usize,
) -> Split {
    let (pm, pn) = (m.div_ceil(p.mr), n.div_ceil(p.nr));
    if threads > 1 && batch == 1 {
        // Tasks span at least MIN_REUSE_TASK rows (or columns): each task streams the whole
        // reused operand through the cache, once per task.
        let tasks = |len: usize, panels: usize| {
            (len / MIN_REUSE_TASK)
                .min(threads * REUSE_TASKS_PER_THREAD)
                .max(threads)
                .min(panels)
        };
        let by_m = (pm >= threads && p.b_whole_len(n, k) <= MAX_REUSE_FLOATS).then_some(Split {
            sm: tasks(m, pm),
            sn: 1,
            reuse: Reuse::B,
        });
        let a_len = if a_rows { 0 } else { p.a_whole_len(m, k) };
        let by_n = (pn >= threads && a_len <= MAX_REUSE_FLOATS).then_some(Split {
            sm: 1,
            sn: tasks(n, pn),
            reuse: if a_rows { Reuse::None } else { Reuse::A },
        });
        // Every worker packs the reused operand in full: reuse the smaller one.
        let found = if n <= m { by_m.or(by_n) } else { by_n.or(by_m) };
        let panels = (pm / (threads * MIN_TASKS_PER_THREAD))
            .clamp(*PHASED_PANELS.start(), *PHASED_PANELS.end());
        match found {
            // A split over n that reads row-major A in place (no reuse) streams all of A
            // through every task: phased, each row range reads its rows once.
            Some(s) if s.sm * s.sn >= threads * MIN_TASKS_PER_THREAD && s.reuse != Reuse::None => {
                return s
            }
            _ if pm / panels >= 2 * threads => {
                return Split {
                    sm: pm / panels,
                    sn: 1,
                    reuse: Reuse::Phased,
                }
            }
            Some(s) => return s,
            None => {}
        }
    }
    let target = if threads > 1 {
        threads * TASKS_PER_THREAD
    } else {
        1
    };
    let need = target.div_ceil(batch);
    let sn_min = n.div_ceil(p.nc);
    let (mut sm, mut sn, mut cost) = (1, sn_min, usize::MAX);
    for sm_try in 1..=pm.min(need) {
        let sn_try = need.div_ceil(sm_try).clamp(sn_min, pn);
        let c = pm.div_ceil(sm_try) * p.mr + pn.div_ceil(sn_try) * p.nr;
        if c < cost {
            (sm, sn, cost) = (sm_try, sn_try, c);
        }
    }
    Split {
        sm,
        sn,
        reuse: Reuse::None,
    }
}

/// A cache line of floats, for tiles on the stack.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Align64([f32; 16]);

/// Calls `f` with this thread's packing buffer, grown to at least `len` floats, 64-byte
/// aligned. One buffer per thread, not a shared pool: a pooled buffer could go to the other
/// core on the next call, and packing into lines that core's cache holds modified costs a
/// cross-core transfer per line (1-3% on `peer`'s shapes, measured A/B in one process).
fn with_packing_buffer<R>(len: usize, f: impl FnOnce(*mut f32) -> R) -> R {
    thread_local! {
        static BUF: RefCell<LineBuffer> = const { RefCell::new(LineBuffer::new()) };
    }
    BUF.with(|buf| match buf.try_borrow_mut() {
        Ok(mut buf) => f(buf.f32s(len).as_mut_ptr()),
        // A GEMM inside a GEMM task on this thread (none does so today) gets its own buffer.
        Err(_) => {
            let mut own = LineBuffer::new();
            f(own.f32s(len).as_mut_ptr())
        }
    })
}

/// A panel layouts (see [`Kernel::tile`]).
const A_KMAJOR: u8 = 0;
const A_ROWS: u8 = 1;
const A_DIRECT: u8 = 2;

/// (row stride, k stride) of A inside one panel for a layout `mode`.
#[inline(always)]
fn a_strides<K: Kernel>(mode: u8, lda: usize) -> (usize, usize) {
    match mode {
        A_KMAJOR => (1, K::MR),
        A_ROWS => (K::KCP, 1),
        _ => (lda, 1),
    }
}

/// A register-tile microkernel and its cache blocking.
///
/// The kernel only broadcasts single A elements, so any A layout with fixed offsets costs
/// the same there. Row-major A is therefore read in place (only a ragged last panel is copied,
/// in rows `i*KCP + p`), and column-major A is packed k-major (`p*MR + i`), which makes its
/// packing a plain copy. Packed B is always
/// k-major (`p*NR + j`) because the kernel loads NR-wide vectors from it, so transposed B
/// needs a real transpose while packing.
trait Kernel {
    const MR: usize;
    const NR: usize;
    /// Depth of one k block; fixed per kernel, never derived from the thread count.
    const KC: usize;
    /// Rows of A packed per block (A block MC x KC should sit in L2).
    const MC: usize;
    /// Max columns of B packed per block (B block KC x NC in L2/L3).
    const NC: usize;
    /// Row stride of row-layout A panels: the pad puts consecutive rows in different L1 sets.
    const KCP: usize = Self::KC + 16;
    /// C[0..MR, 0..NR] (row stride `ldc`) = (load_c ? C : 0) + sum_p A(i, p) * b[p*NR+j],
    /// as one fused chain per element, in p order. `MODE` selects where A(i, p) is:
    /// [`A_KMAJOR`] `a[p*MR + i]`, [`A_ROWS`] `a[i*KCP + p]`, [`A_DIRECT`] `a[i*lda + p]`.
    ///
    /// # Safety
    /// `a` holds one A panel as `MODE` says, `b` kc*NR floats, `c` a full MR x NR tile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const MODE: u8>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    );

    /// Hints that the MR x NR C tile at `c` is needed soon. After the first k block each tile
    /// must load C before its first FMA (that is what keeps the chain exact), so without this
    /// the kernel would stall on a cache miss at every tile start.
    #[inline(always)]
    fn prefetch_c(_c: *const f32, _ldc: usize) {}

    /// Packs one full NR-wide B panel whose columns are contiguous (B transposed):
    /// `d[p*NR + j] = s[j*cs + p]`.
    ///
    /// # Safety
    /// `s` valid for NR columns of kc floats at stride `cs`; `d` for kc*NR writes.
    #[inline(always)]
    unsafe fn pack_b_t(d: *mut f32, s: *const f32, cs: usize, kc: usize) {
        unsafe {
            for j in 0..Self::NR {
                for p in 0..kc {
                    *d.add(p * Self::NR + j) = *s.add(j * cs + p);
                }
            }
        }
    }
}

/// One task: a (batch, m-tile, n-tile) block of C over the whole k range.
///
/// # Safety
/// `ctx` describes valid buffers; `buf` holds the packing space computed in `sgemm_path`, and
/// `packed` is 0 on this worker's first task of the call.
#[inline(always)]
unsafe fn run_task<K: Kernel>(ctx: &Ctx, t: usize, buf: *mut f32, packed: &mut usize) {
    if ctx.reuse == Reuse::Phased {
        // SAFETY: forwarded.
        return unsafe { run_phased::<K>(ctx, t, buf, packed) };
    }
    unsafe {
        let per_batch = ctx.sm * ctx.sn;
        let bi = t / per_batch;
        let rem = t % per_batch;
        // Consecutive tasks share an n range so its B columns stay warm in cache.
        let ni = rem / ctx.sm;
        let mi = rem % ctx.sm;
        // Whole panels, spread evenly so tasks differ by at most one panel.
        let m0 = mi * ctx.pm / ctx.sm * ctx.mr;
        let m1 = ctx.m.min((mi + 1) * ctx.pm / ctx.sm * ctx.mr);
        let n0 = ni * ctx.pn / ctx.sn * ctx.nr;
        let n1 = ctx.n.min((ni + 1) * ctx.pn / ctx.sn * ctx.nr);
        let a = ctx.a.add(bi * ctx.a_bs);
        let b = ctx.b.add(bi * ctx.b_bs);
        let c = ctx.c.add(bi * ctx.m * ctx.n);
        let abuf = buf;
        let bbuf = buf.add(ctx.b_off);
        let ldc = ctx.n;
        // Row-major A is read in place, never packed: copying it cost more than its padded
        // rows saved, at any width of B (4-7% on `peer`'s row-major shapes, one or two
        // threads, measured A/B in one process). Only column-major A is packed, k-major.
        let direct = ctx.a_cs == 1;

        // Where block (jc, pc) of B sits when this worker keeps all of B (tasks span all of n,
        // so n0 = 0): column blocks of NC x k one after another, k blocks inside each.
        let b_cached =
            |jc: usize, nc: usize, pc: usize| (jc - n0) * ctx.k + nc.next_multiple_of(K::NR) * pc;
        // Where rows ic.. of k block pc of A sit when this worker keeps all of A (m0 = 0).
        let a_cached = |ic: usize, kc: usize, pc: usize| abuf.add(pc / K::KC * ctx.a_blk + ic * kc);
        // This worker's first task packs the reused operand block by block, just before its
        // first use, while the block is still in cache.
        let first = *packed == 0;
        *packed = 1;

        let mut jc = n0;
        while jc < n1 {
            let nc = K::NC.min(n1 - jc);
            let mut pc = 0;
            while pc < ctx.k {
                let kc = K::KC.min(ctx.k - pc);
                let bblk = match ctx.reuse {
                    Reuse::B => bbuf.add(b_cached(jc, nc, pc)),
                    _ => bbuf,
                };
                if ctx.reuse != Reuse::B || first {
                    let src = b.add(pc * ctx.b_rs + jc * ctx.b_cs);
                    pack_b::<K>(bblk, src, ctx.b_rs, ctx.b_cs, kc, nc);
                }
                let mut ic = m0;
                while ic < m1 {
                    let mc = K::MC.min(m1 - ic);
                    let asrc = a.add(ic * ctx.a_rs + pc * ctx.a_cs);
                    let cp = c.add(ic * ldc + jc);
                    let lda = ctx.a_rs;
                    let load = pc > 0;
                    if direct {
                        direct_rows::<K>(kc, mc, nc, asrc, lda, abuf, bblk, cp, ldc, load);
                    } else {
                        let ablk = match ctx.reuse {
                            Reuse::A => a_cached(ic, kc, pc),
                            _ => abuf,
                        };
                        if ctx.reuse != Reuse::A || (first && jc == n0) {
                            pack_a_kmajor::<K>(ablk, asrc, lda, ctx.a_cs, mc, kc);
                        }
                        macro_kernel::<K, A_KMAJOR>(kc, mc, nc, ablk, 0, bblk, cp, ldc, load);
                    }
                    ic += mc;
                }
                pc += kc;
            }
            jc += nc;
        }
    }
}

/// One task of a [`Reuse::Phased`] call: k block `t / sm` of row range `t % sm`, over all of
/// n. The worker packs that k block of B into its buffer unless it already holds it (its k
/// blocks only ever grow, as tasks are claimed in order), and its A rows when A is
/// column-major. The task first waits until the range's previous k block is done, on whichever
/// core it ran, so every element of C is still one fused chain in k order.
///
/// # Safety
/// As for [`run_task`].
#[inline(always)]
unsafe fn run_phased<K: Kernel>(ctx: &Ctx, t: usize, buf: *mut f32, packed: &mut usize) {
    let (kb, range) = (t / ctx.sm, t % ctx.sm);
    let pc = kb * K::KC;
    let kc = K::KC.min(ctx.k - pc);
    unsafe {
        let bblk = buf.add(ctx.b_off);
        if *packed != kb + 1 {
            pack_b::<K>(
                bblk,
                ctx.b.add(pc * ctx.b_rs),
                ctx.b_rs,
                ctx.b_cs,
                kc,
                ctx.n,
            );
            *packed = kb + 1;
        }
        let mut spins = 0u32;
        while ctx.blocks_done[range].load(Ordering::Acquire) < kb {
            // The other core runs the block we wait for; if it stops running for a while (a
            // shared host), let the OS give this core to it.
            if spins < 1 << 14 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
        let m0 = range * ctx.pm / ctx.sm * K::MR;
        let m1 = ctx.m.min((range + 1) * ctx.pm / ctx.sm * K::MR);
        let (ldc, lda, load) = (ctx.n, ctx.a_rs, pc > 0);
        let mut jc = 0;
        while jc < ctx.n {
            let nc = K::NC.min(ctx.n - jc);
            let bj = bblk.add(jc * kc);
            let mut ic = m0;
            while ic < m1 {
                let mc = K::MC.min(m1 - ic);
                let asrc = ctx.a.add(ic * ctx.a_rs + pc * ctx.a_cs);
                let cp = ctx.c.add(ic * ldc + jc);
                if ctx.a_cs == 1 {
                    direct_rows::<K>(kc, mc, nc, asrc, lda, buf, bj, cp, ldc, load);
                } else {
                    pack_a_kmajor::<K>(buf, asrc, lda, ctx.a_cs, mc, kc);
                    macro_kernel::<K, A_KMAJOR>(kc, mc, nc, buf, 0, bj, cp, ldc, load);
                }
                ic += mc;
            }
            jc += nc;
        }
        ctx.blocks_done[range].store(kb + 1, Ordering::Release);
    }
}

/// Whole MR-row panels of row-major A read in place; the ragged tail (< MR rows) is copied
/// into `abuf` first, so that the kernel never reads rows past A.
///
/// # Safety
/// As for [`macro_kernel`]; `abuf` has room for one A panel in [`A_ROWS`] layout.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn direct_rows<K: Kernel>(
    kc: usize,
    mc: usize,
    nc: usize,
    a: *const f32,
    lda: usize,
    abuf: *mut f32,
    bblk: *const f32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    let full = mc / K::MR * K::MR;
    unsafe {
        if full > 0 {
            macro_kernel::<K, A_DIRECT>(kc, full, nc, a, lda, bblk, c, ldc, load_c);
        }
        if full < mc {
            let (a, c) = (a.add(full * lda), c.add(full * ldc));
            pack_a_rows::<K>(abuf, a, lda, mc - full, kc);
            macro_kernel::<K, A_ROWS>(kc, mc - full, nc, abuf, 0, bblk, c, ldc, load_c);
        }
    }
}

/// # Safety
/// Packed panels as produced by `pack_a_*`/`pack_b` (or, for [`A_DIRECT`], A itself with
/// whole MR-row panels); `c` valid for the mc x nc block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn macro_kernel<K: Kernel, const MODE: u8>(
    kc: usize,
    mc: usize,
    nc: usize,
    abuf: *const f32,
    lda: usize,
    bbuf: *const f32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    let a_panel = if MODE == A_KMAJOR {
        K::MR * kc
    } else {
        K::MR * a_strides::<K>(MODE, lda).0
    };
    unsafe {
        let mut jr = 0;
        while jr < nc {
            let nr = K::NR.min(nc - jr);
            let bp = bbuf.add(jr * kc);
            let mut ir = 0;
            while ir < mc {
                let mr = K::MR.min(mc - ir);
                let ap = abuf.add(ir / K::MR * a_panel);
                let cp = c.add(ir * ldc + jr);
                // Only tiles that load C stall on it; for the first k block the stores just
                // drain through the store buffer and extra prefetches would only compete.
                if load_c {
                    if ir + K::MR < mc {
                        K::prefetch_c(cp.add(K::MR * ldc), ldc);
                    } else if jr + K::NR < nc {
                        K::prefetch_c(c.add(jr + K::NR), ldc);
                    }
                }
                if mr == K::MR && nr == K::NR {
                    K::tile::<MODE>(kc, ap, lda, bp, cp, ldc, load_c);
                } else {
                    // Edge: run the full tile on a padded copy (padding rows/cols of the
                    // packed panels are zero) and write back only the valid part.
                    let mut tmp = [Align64([0.0; 16]); MAX_TILE / 16];
                    let tp = tmp.as_mut_ptr() as *mut f32;
                    if load_c {
                        for i in 0..mr {
                            std::ptr::copy_nonoverlapping(cp.add(i * ldc), tp.add(i * K::NR), nr);
                        }
                    }
                    K::tile::<MODE>(kc, ap, lda, bp, tp, K::NR, load_c);
                    for i in 0..mr {
                        std::ptr::copy_nonoverlapping(tp.add(i * K::NR), cp.add(i * ldc), nr);
                    }
                }
                ir += K::MR;
            }
            jr += K::NR;
        }
    }
}

/// Row layout for A with contiguous rows (cs == 1): each panel row is one memcpy.
///
/// # Safety
/// `src` valid for mc rows of kc floats at stride `rs`; `dst` for ceil(mc/MR)*MR*KCP writes.
#[inline(always)]
unsafe fn pack_a_rows<K: Kernel>(dst: *mut f32, src: *const f32, rs: usize, mc: usize, kc: usize) {
    unsafe {
        let mut i = 0;
        while i < mc.next_multiple_of(K::MR) {
            let d = dst.add(i / K::MR * K::MR * K::KCP + i % K::MR * K::KCP);
            if i < mc {
                std::ptr::copy_nonoverlapping(src.add(i * rs), d, kc);
            } else {
                // Zero padding rows: stale floats could be denormals, which are slow in FMA.
                std::ptr::write_bytes(d, 0, kc);
            }
            i += 1;
        }
    }
}

/// k-major layout for A (any strides; a memcpy of MR floats per k when rs == 1).
///
/// # Safety
/// `src` valid for the described reads, `dst` for ceil(mc/MR)*MR*kc writes.
#[inline(always)]
unsafe fn pack_a_kmajor<K: Kernel>(
    dst: *mut f32,
    src: *const f32,
    rs: usize,
    cs: usize,
    mc: usize,
    kc: usize,
) {
    let mr_ = K::MR;
    unsafe {
        let mut d = dst;
        let mut i0 = 0;
        while i0 < mc {
            let rows = mr_.min(mc - i0);
            let s = src.add(i0 * rs);
            if rows == mr_ && rs == 1 {
                for p in 0..kc {
                    std::ptr::copy_nonoverlapping(s.add(p * cs), d.add(p * mr_), mr_);
                }
            } else {
                for p in 0..kc {
                    for i in 0..mr_ {
                        *d.add(p * mr_ + i) = if i < rows {
                            *s.add(i * rs + p * cs)
                        } else {
                            0.0
                        };
                    }
                }
            }
            d = d.add(kc * mr_);
            i0 += mr_;
        }
    }
}

/// Packs B[0..kc, 0..nc] into ceil(nc/NR) panels, each kc x NR (NR contiguous), zero padded.
///
/// # Safety
/// `src` valid for the described reads, `dst` for ceil(nc/NR)*NR*kc writes.
#[inline(always)]
unsafe fn pack_b<K: Kernel>(
    dst: *mut f32,
    src: *const f32,
    rs: usize,
    cs: usize,
    kc: usize,
    nc: usize,
) {
    let nr_ = K::NR;
    unsafe {
        let mut d = dst;
        let mut j0 = 0;
        while j0 < nc {
            let cols = nr_.min(nc - j0);
            let s = src.add(j0 * cs);
            if cols == nr_ && cs == 1 {
                for p in 0..kc {
                    std::ptr::copy_nonoverlapping(s.add(p * rs), d.add(p * nr_), nr_);
                }
            } else if cols == nr_ && rs == 1 {
                K::pack_b_t(d, s, cs, kc);
            } else {
                for p in 0..kc {
                    for j in 0..nr_ {
                        *d.add(p * nr_ + j) = if j < cols {
                            *s.add(p * rs + j * cs)
                        } else {
                            0.0
                        };
                    }
                }
            }
            d = d.add(kc * nr_);
            j0 += nr_;
        }
    }
}

/// Portable fallback: same blocking, plain Rust tile.
struct Scalar;

#[inline(always)]
fn fmadd_scalar(a: f32, b: f32, c: f32) -> f32 {
    // Fused only where it is a single instruction; a libm call per element would be far
    // slower than the rounding difference is worth.
    if cfg!(any(target_arch = "aarch64", target_feature = "fma")) {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

impl Kernel for Scalar {
    const MR: usize = 4;
    const NR: usize = 8;
    const KC: usize = 256;
    const MC: usize = 128;
    const NC: usize = 2048;
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const MODE: u8>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        let (ars, aks) = a_strides::<Self>(MODE, lda);
        unsafe {
            let mut acc = [[0.0f32; 8]; 4];
            if load_c {
                for (i, row) in acc.iter_mut().enumerate() {
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = *c.add(i * ldc + j);
                    }
                }
            }
            for p in 0..kc {
                let ap = a.add(p * aks);
                let bp = b.add(p * 8);
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = *ap.add(i * ars);
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = fmadd_scalar(ai, *bp.add(j), *v);
                    }
                }
            }
            for (i, row) in acc.iter().enumerate() {
                for (j, v) in row.iter().enumerate() {
                    *c.add(i * ldc + j) = *v;
                }
            }
        }
    }
}

/// # Safety
/// See [`run_task`].
unsafe fn task_scalar(ctx: &Ctx, t: usize, buf: *mut f32, packed: &mut usize) {
    unsafe { run_task::<Scalar>(ctx, t, buf, packed) }
}

/// Runs a register tile's `n` k steps in k order (so the same FMA chains), four to an
/// iteration of the loop: `step(a, b)` with `a` and `b` advanced by their strides each step.
/// One step per iteration left the loop's address and counter updates a measurable share of
/// the tiles' rate (Zen 3's AVX2 tile, the Xeon's AVX-512 tiles; docs/benchmarks.md).
///
/// # Safety
/// `step` is given `a + s * a_stride` and `b + s * b_stride` for every `s < n`: both must stay
/// inside their allocations.
#[inline(always)]
pub(super) unsafe fn k_steps_in_fours<T>(
    n: usize,
    (mut a, a_stride): (*const T, usize),
    (mut b, b_stride): (*const T, usize),
    mut step: impl FnMut(*const T, *const T),
) {
    unsafe {
        for _ in 0..n / 4 {
            for u in 0..4 {
                step(a.add(u * a_stride), b.add(u * b_stride));
            }
            a = a.add(4 * a_stride);
            b = b.add(4 * b_stride);
        }
        for _ in 0..n % 4 {
            step(a, b);
            a = a.add(a_stride);
            b = b.add(b_stride);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{a_strides, run_task, Ctx, Kernel};
    use std::arch::x86_64::*;

    const _: () = assert!(Avx2::MR * Avx2::NR <= super::MAX_TILE);
    const _: () = assert!(Avx512::MR * Avx512::NR <= super::MAX_TILE);

    pub struct Avx2;

    impl Kernel for Avx2 {
        const MR: usize = 6;
        const NR: usize = 16;
        const KC: usize = 256;
        const MC: usize = 144;
        const NC: usize = 2048;
        #[inline(always)]
        unsafe fn tile<const MODE: u8>(
            kc: usize,
            a: *const f32,
            lda: usize,
            b: *const f32,
            c: *mut f32,
            ldc: usize,
            load_c: bool,
        ) {
            unsafe { tile_6x16::<MODE>(kc, a, lda, b, c, ldc, load_c) }
        }
        #[inline(always)]
        unsafe fn pack_b_t(d: *mut f32, s: *const f32, cs: usize, kc: usize) {
            unsafe { pack_b_t_avx::<16>(d, s, cs, kc) }
        }
        #[inline(always)]
        fn prefetch_c(c: *const f32, ldc: usize) {
            prefetch_tile::<{ Self::MR }, { Self::NR }>(c, ldc)
        }
    }

    /// # Safety
    /// See [`Kernel::tile`]; CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_6x16<const MODE: u8>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        let (ars, aks) = a_strides::<Avx2>(MODE, lda);
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; 6];
            if load_c {
                for (i, r) in acc.iter_mut().enumerate() {
                    r[0] = _mm256_loadu_ps(c.add(i * ldc));
                    r[1] = _mm256_loadu_ps(c.add(i * ldc + 8));
                }
            }
            // One k step: the 12 accumulators each take one more fused term.
            let step = |acc: &mut [[__m256; 2]; 6], a: *const f32, b: *const f32| {
                let b0 = _mm256_load_ps(b);
                let b1 = _mm256_load_ps(b.add(8));
                for (i, r) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*a.add(i * ars));
                    r[0] = _mm256_fmadd_ps(ai, b0, r[0]);
                    r[1] = _mm256_fmadd_ps(ai, b1, r[1]);
                }
            };
            // With one k step per iteration, the loop's address and counter updates cost 12-15%
            // of this kernel's rate on Zen 3 (a throwaway bench of both loops over `peer`'s
            // 2048x256x256, alternated).
            super::k_steps_in_fours(kc, (a, aks), (b, 16), |a, b| step(&mut acc, a, b));
            for (i, r) in acc.iter().enumerate() {
                _mm256_storeu_ps(c.add(i * ldc), r[0]);
                _mm256_storeu_ps(c.add(i * ldc + 8), r[1]);
            }
        }
    }

    /// Prefetches every cache line of an MR x NR tile; the addresses may lie
    /// past the matrix (edge tiles), which is harmless for prefetches.
    #[inline(always)]
    fn prefetch_tile<const MR: usize, const NR: usize>(c: *const f32, ldc: usize) {
        for i in 0..MR {
            let row = c.wrapping_add(i * ldc) as *const i8;
            // SAFETY: prefetch never faults, whatever the address.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(row);
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(NR * 4 - 1));
            }
        }
    }

    /// Transposes 8x8 blocks in registers: a scalar or gather/scatter loop is several
    /// times slower and B^T packing is redone for every m tile.
    ///
    /// # Safety
    /// See [`Kernel::pack_b_t`]; CPU must have AVX2.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack_b_t_avx<const NR: usize>(d: *mut f32, s: *const f32, cs: usize, kc: usize) {
        unsafe {
            let mut p = 0;
            while p + 8 <= kc {
                for jb in (0..NR).step_by(8) {
                    let r: [__m256; 8] =
                        std::array::from_fn(|j| _mm256_loadu_ps(s.add((jb + j) * cs + p)));
                    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                    let o = [
                        _mm256_permute2f128_ps::<0x20>(u0, u4),
                        _mm256_permute2f128_ps::<0x20>(u1, u5),
                        _mm256_permute2f128_ps::<0x20>(u2, u6),
                        _mm256_permute2f128_ps::<0x20>(u3, u7),
                        _mm256_permute2f128_ps::<0x31>(u0, u4),
                        _mm256_permute2f128_ps::<0x31>(u1, u5),
                        _mm256_permute2f128_ps::<0x31>(u2, u6),
                        _mm256_permute2f128_ps::<0x31>(u3, u7),
                    ];
                    for (q, v) in o.iter().enumerate() {
                        _mm256_storeu_ps(d.add((p + q) * NR + jb), *v);
                    }
                }
                p += 8;
            }
            while p < kc {
                for j in 0..NR {
                    *d.add(p * NR + j) = *s.add(j * cs + p);
                }
                p += 1;
            }
        }
    }

    /// # Safety
    /// See [`run_task`]; CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn task_avx2(ctx: &Ctx, t: usize, buf: *mut f32, packed: &mut usize) {
        unsafe { run_task::<Avx2>(ctx, t, buf, packed) }
    }

    pub struct Avx512;

    impl Kernel for Avx512 {
        const MR: usize = 12;
        const NR: usize = 32;
        const KC: usize = 256;
        const MC: usize = 144;
        const NC: usize = 2048;
        #[inline(always)]
        unsafe fn tile<const MODE: u8>(
            kc: usize,
            a: *const f32,
            lda: usize,
            b: *const f32,
            c: *mut f32,
            ldc: usize,
            load_c: bool,
        ) {
            unsafe { tile_12x32::<MODE>(kc, a, lda, b, c, ldc, load_c) }
        }
        #[inline(always)]
        unsafe fn pack_b_t(d: *mut f32, s: *const f32, cs: usize, kc: usize) {
            unsafe { pack_b_t_avx::<32>(d, s, cs, kc) }
        }
        #[inline(always)]
        fn prefetch_c(c: *const f32, ldc: usize) {
            prefetch_tile::<{ Self::MR }, { Self::NR }>(c, ldc)
        }
    }

    /// # Safety
    /// See [`Kernel::tile`]; CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_12x32<const MODE: u8>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        let (ars, aks) = a_strides::<Avx512>(MODE, lda);
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; 12];
            if load_c {
                for (i, r) in acc.iter_mut().enumerate() {
                    r[0] = _mm512_loadu_ps(c.add(i * ldc));
                    r[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
                }
            }
            let step = |acc: &mut [[__m512; 2]; 12], a: *const f32, b: *const f32| {
                let b0 = _mm512_load_ps(b);
                let b1 = _mm512_load_ps(b.add(16));
                for (i, r) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.add(i * ars));
                    r[0] = _mm512_fmadd_ps(ai, b0, r[0]);
                    r[1] = _mm512_fmadd_ps(ai, b1, r[1]);
                }
            };
            // Four k steps per iteration: on the AVX-512 Xeon every `peer` shape ran 2-7% faster
            // than with one (`gemm_shapes 2`, six alternated runs); on Zen 4, which splits each
            // 512-bit op in two, it made no difference.
            super::k_steps_in_fours(kc, (a, aks), (b, 32), |a, b| step(&mut acc, a, b));
            for (i, r) in acc.iter().enumerate() {
                _mm512_storeu_ps(c.add(i * ldc), r[0]);
                _mm512_storeu_ps(c.add(i * ldc + 16), r[1]);
            }
        }
    }

    /// # Safety
    /// See [`run_task`]; CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn task_avx512(ctx: &Ctx, t: usize, buf: *mut f32, packed: &mut usize) {
        unsafe { run_task::<Avx512>(ctx, t, buf, packed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// A test problem: operands stored with optional transposition and padded strides.
    struct Prob {
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        a: Vec<f32>,
        la: Layout,
        b: Vec<f32>,
        lb: Layout,
    }

    /// `pad` adds unused elements per stored row to exercise general strides.
    fn layout(rows: usize, cols: usize, trans: bool, pad: usize, batch: usize) -> (Layout, usize) {
        let (rs, cs, stored_rows, ld) = if trans {
            (1, rows + pad, cols, rows + pad)
        } else {
            (cols + pad, 1, rows, cols + pad)
        };
        let bs = stored_rows * ld;
        (
            Layout {
                row_stride: rs,
                col_stride: cs,
                batch_stride: bs,
            },
            bs * batch.max(1),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn prob(
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tb: bool,
        shared_b: bool,
        pad: usize,
        seed: u64,
    ) -> Prob {
        let mut rng = Lcg(seed);
        let (la, alen) = layout(m, k, ta, pad, batch);
        let (mut lb, blen) = layout(k, n, tb, pad, if shared_b { 1 } else { batch });
        if shared_b {
            lb.batch_stride = 0;
        }
        let a = (0..alen).map(|_| rng.next()).collect();
        let b = (0..blen).map(|_| rng.next()).collect();
        Prob {
            batch,
            m,
            n,
            k,
            a,
            la,
            b,
            lb,
        }
    }

    fn at(v: &[f32], l: Layout, bi: usize, r: usize, c: usize) -> f32 {
        v[bi * l.batch_stride + r * l.row_stride + c * l.col_stride]
    }

    fn run_path(p: &Prob, path: Path, threads: usize) -> Vec<f32> {
        let mut c = vec![f32::NAN; p.batch * p.m * p.n];
        unsafe {
            sgemm_path(
                path,
                p.batch,
                p.m,
                p.n,
                p.k,
                p.a.as_ptr(),
                p.la,
                p.b.as_ptr(),
                p.lb,
                c.as_mut_ptr(),
                threads,
            )
        };
        c
    }

    /// The vector paths are among those the GEMM tests run wherever the cpu has them.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx2),
        ignore = "this cpu has no AVX2 and FMA: the AVX2 GEMM path is not run here"
    )]
    fn the_avx2_path_is_tested_here() {
        assert!(paths().contains(&Path::Avx2), "{:?}", paths());
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx512f),
        ignore = "this cpu has no AVX-512F: the AVX-512 GEMM path is not run here"
    )]
    fn the_avx512_path_is_tested_here() {
        assert!(paths().contains(&Path::Avx512), "{:?}", paths());
    }

    fn paths() -> Vec<Path> {
        let mut v = vec![Path::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Path::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
        }
        v
    }

    /// f64 reference; checks |c - ref| <= 1e-5 * sum_k |a*b| (the scale of rounding error
    /// for a length-k dot product, robust to cancellation).
    fn check_ref(p: &Prob, c: &[f32], what: &str) {
        // Big problems: every 5th row plus the last 12 (edge tiles), so the f64 reference
        // stays cheap in debug builds too.
        let big = p.batch * p.m * p.n * p.k > 1 << 24;
        for bi in 0..p.batch {
            for i in (0..p.m).filter(|&i| !big || i % 5 == 0 || i + 12 >= p.m) {
                for j in 0..p.n {
                    let (mut s, mut sa) = (0.0f64, 0.0f64);
                    for q in 0..p.k {
                        let x = at(&p.a, p.la, bi, i, q) as f64 * at(&p.b, p.lb, bi, q, j) as f64;
                        s += x;
                        sa += x.abs();
                    }
                    let got = c[(bi * p.m + i) * p.n + j] as f64;
                    assert!(
                        (got - s).abs() <= 1e-5 * sa + 1e-30,
                        "{what}: b{bi} ({i},{j}) got {got} want {s} scale {sa}"
                    );
                }
            }
        }
    }

    /// The exact chain the contract promises: fma in k order from 0.
    fn fma_chain(p: &Prob) -> Vec<f32> {
        let mut c = vec![0.0f32; p.batch * p.m * p.n];
        for bi in 0..p.batch {
            for i in 0..p.m {
                for j in 0..p.n {
                    let mut acc = 0.0f32;
                    for q in 0..p.k {
                        acc = at(&p.a, p.la, bi, i, q).mul_add(at(&p.b, p.lb, bi, q, j), acc);
                    }
                    c[(bi * p.m + i) * p.n + j] = acc;
                }
            }
        }
        c
    }

    fn same_bits(x: &[f32], y: &[f32]) -> bool {
        x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
    }

    const SMALL: &[(usize, usize, usize, usize)] = &[
        (1, 1, 1, 1),
        (1, 7, 300, 13),
        (1, 33, 65, 17),
        (1, 256, 32, 256),
        (2, 37, 50, 300),
        (1, 100, 20, 513),
        (3, 13, 37, 300),
        (2, 5, 70, 600),
        (4, 64, 64, 64),
    ];

    #[test]
    fn small_all_layouts_all_paths() {
        let mut seed = 1;
        for &(batch, m, n, k) in SMALL {
            for ta in [false, true] {
                for tb in [false, true] {
                    for shared in [false, true] {
                        for pad in [0, 3] {
                            seed += 1;
                            let p = prob(batch, m, n, k, ta, tb, shared, pad, seed);
                            for path in paths() {
                                let c = run_path(&p, path, 2);
                                let what = format!(
                                    "{path:?} {batch}x({m},{n},{k}) ta={ta} tb={tb} shared={shared} pad={pad}"
                                );
                                check_ref(&p, &c, &what);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn llm_shapes_match_reference() {
        let shapes: &[(usize, usize, usize, usize, bool, bool)] = &[
            (1, 2048, 256, 768, false, false),
            (1, 2048, 768, 256, false, true),
            (1, 256, 768, 2048, true, false),
            (1, 2048, 2048, 256, false, true),
            (64, 256, 256, 32, false, true),
            (64, 256, 32, 256, false, false),
            (8, 256, 32, 256, true, true),
        ];
        for (s, &(batch, m, n, k, ta, tb)) in shapes.iter().enumerate() {
            let p = prob(batch, m, n, k, ta, tb, false, 0, 100 + s as u64);
            let c = unsafe {
                let mut c = vec![f32::NAN; batch * m * n];
                sgemm(
                    batch,
                    m,
                    n,
                    k,
                    p.a.as_ptr(),
                    p.la,
                    p.b.as_ptr(),
                    p.lb,
                    c.as_mut_ptr(),
                    2,
                );
                c
            };
            check_ref(&p, &c, &format!("{batch}x({m},{n},{k}) ta={ta} tb={tb}"));
        }
    }

    #[test]
    fn shared_b_folded_batch() {
        // Row-major A with contiguous batches takes the fold-into-m path.
        let p = prob(5, 37, 50, 270, false, false, true, 0, 7);
        for path in paths() {
            check_ref(&p, &run_path(&p, path, 3), &format!("{path:?} folded"));
        }
        let p = prob(5, 37, 50, 270, false, true, true, 2, 8);
        for path in paths() {
            check_ref(
                &p,
                &run_path(&p, path, 3),
                &format!("{path:?} padded shared"),
            );
        }
    }

    #[test]
    fn bitwise_across_threads_and_runs() {
        let shapes: &[(usize, usize, usize, usize, bool, bool)] = &[
            (1, 33, 65, 17, false, false),
            (1, 300, 200, 700, false, true),
            (1, 515, 260, 700, false, false),
            (16, 256, 32, 256, false, false),
            (9, 100, 64, 70, false, true),
            (3, 130, 70, 513, true, true),
            // One task per worker or several, reusing packed A (rows or k-major) or packed B
            // (over several column blocks): see `splits_reuse_the_smaller_operand`.
            (1, 130, 700, 600, false, false),
            (1, 130, 700, 600, true, true),
            (1, 2200, 2100, 100, false, true),
        ];
        let shapes = shapes.iter().chain(PHASED_SHAPES);
        for (s, &(batch, m, n, k, ta, tb)) in shapes.enumerate() {
            let p = prob(batch, m, n, k, ta, tb, false, 0, 200 + s as u64);
            for path in paths() {
                let c1 = run_path(&p, path, 1);
                for t in [1, 2, 3, 8] {
                    assert!(
                        same_bits(&c1, &run_path(&p, path, t)),
                        "{path:?} threads={t} shape {s}"
                    );
                }
            }
        }
    }

    #[test]
    fn splits_reuse_the_smaller_operand() {
        for path in paths() {
            let p = path_params(path);
            let split = |batch, m, n, k, a_rows, threads| {
                let s = split(&p, batch, m, n, k, a_rows, threads);
                (s.sm, s.sn, s.reuse)
            };
            let (b, a, none, phased) = (Reuse::B, Reuse::A, Reuse::None, Reuse::Phased);
            // Enough tasks per thread: the reused operand, tasks of at least MIN_REUSE_TASK
            // rows, at most REUSE_TASKS_PER_THREAD per thread.
            assert_eq!(split(1, 4096, 200, 700, true, 2), (16, 1, b), "{path:?}");
            // Too few, but m too small to go phased: the reused operand all the same.
            assert_eq!(split(1, 60, 700, 600, false, 3), (1, 5, a), "{path:?}");
            // Row-major A is never packed, so there is nothing to reuse, whatever its size.
            assert_eq!(split(1, 60, 700, 600, true, 3), (1, 5, none), "{path:?}");
            // Too few tasks, nothing fits, or every task would read all of A, and m has the
            // rows: phased, in ranges of 4-8 panels.
            let pm = |m: usize| m.div_ceil(p.mr);
            let ranges = |m: usize, threads: usize| pm(m) / (pm(m) / (threads * 4)).clamp(4, 8);
            for (m, n, k, a_rows) in [
                (2048, 2048, 2048, false),
                (768, 256, 2048, true),
                (1000, 2000, 3000, true),
            ] {
                let want = (ranges(m, 2), 1, phased);
                assert_eq!(split(1, m, n, k, a_rows, 2), want, "{path:?} {m}x{n}x{k}");
            }
            // Nothing fits and m is small: one task per thread, no reuse.
            assert_eq!(split(1, 60, 2048, 8192, false, 2).2, none, "{path:?}");
            // Batches, one thread: one task per thread, no reuse.
            assert_eq!(split(3, 300, 200, 700, false, 2).2, none, "{path:?}");
            assert_eq!(split(1, 300, 200, 700, false, 1), (1, 1, none), "{path:?}");
        }
    }

    /// Shapes whose two-thread split is phased on every path (checked where they are used):
    /// three k blocks, ragged m and n, A column-major (packed) and row-major (in place).
    const PHASED_SHAPES: &[(usize, usize, usize, usize, bool, bool)] = &[
        (1, 200, 70, 600, true, false),
        (1, 200, 70, 600, false, true),
    ];

    fn assert_phased(p: &Prob, path: Path) {
        let s = split(
            &path_params(path),
            p.batch,
            p.m,
            p.n,
            p.k,
            p.la.col_stride == 1,
            2,
        );
        assert_eq!(s.reuse, Reuse::Phased, "{path:?} {}x{}x{}", p.m, p.n, p.k);
    }

    #[test]
    fn simd_paths_are_the_exact_fma_chain() {
        let shapes: &[(usize, usize, usize, usize, bool, bool)] = &[
            (1, 1, 1, 1, false, false),
            (1, 33, 65, 17, false, true),
            // k blocks that leave 3 and 2 steps after the kernel's four-step loop.
            (1, 14, 40, 19, true, false),
            (1, 13, 20, 270, false, false),
            (2, 50, 70, 600, true, false),
            (1, 130, 96, 1000, false, false),
        ];
        for (s, &(batch, m, n, k, ta, tb)) in shapes.iter().chain(PHASED_SHAPES).enumerate() {
            let p = prob(batch, m, n, k, ta, tb, false, 1, 300 + s as u64);
            let want = fma_chain(&p);
            for path in paths() {
                if s >= shapes.len() {
                    assert_phased(&p, path);
                }
                if path == Path::Scalar
                    && !cfg!(any(target_arch = "aarch64", target_feature = "fma"))
                {
                    continue;
                }
                assert!(
                    same_bits(&want, &run_path(&p, path, 2)),
                    "{path:?} shape {s}"
                );
            }
        }
    }

    #[test]
    fn zero_sizes() {
        for &(batch, m, n, k) in &[
            (0, 4, 4, 4),
            (2, 0, 4, 4),
            (2, 4, 0, 4),
            (2, 4, 4, 0),
            (0, 0, 0, 0),
        ] {
            let p = prob(batch, m, n, k, false, false, false, 0, 9);
            for path in paths() {
                let c = run_path(&p, path, 3);
                assert_eq!(c.len(), batch * m * n);
                assert!(
                    c.iter().all(|&x| x == 0.0),
                    "{path:?} {batch}x({m},{n},{k})"
                );
            }
        }
        // Dangling pointers are fine when nothing is read or written.
        let l = Layout {
            row_stride: 1,
            col_stride: 1,
            batch_stride: 0,
        };
        let d = std::ptr::NonNull::<f32>::dangling().as_ptr();
        unsafe { sgemm(0, 5, 5, 5, d, l, d, l, d, 4) };
        unsafe { sgemm(3, 0, 5, 5, d, l, d, l, d, 4) };
    }
}
