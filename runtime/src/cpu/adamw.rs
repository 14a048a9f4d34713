//! AdamW on the cpu backend: one host step over every parameter of the update.
//!
//! Why: decomposed, AdamW is one kernel per output (`p'`, `m'`, `v'`) per parameter, each
//! re-reading the gradient and the moments it needs: 11 floats moved per element where one pass
//! moves 7, in 3 launches per parameter. Here one pool job covers all parameters, split into
//! chunks of about equal size, so the many small ones (norm weights) cost nothing extra.
//!
//! Numerics: the decomposition's f32 operations in its order (`graphtrain_ir::decompose`): the
//! hyperparameters as f32 (`1 - beta` computed in f64 first), the bias corrections from
//! `beta^t` in f32, and per element
//! `m' = m·b1 + g·(1 - b1)`, `v' = v·b2 + (g·g)·(1 - b2)`,
//! `p' = p·(lr·(-wd) + 1) - ((lr / bc1)·m') / (sqrt(v') / sqrt(bc2) + eps)`.
//! Each element is independent, so the split never changes a bit.

use super::pool::{Pool, TaskPtr};

/// The arena, shared by the tasks: every element is read and written at its own index by
/// exactly one task.
type Arena = TaskPtr<f32>;

/// One parameter's element offsets in the arena: inputs, then the outputs replacing them.
#[derive(Clone, Copy, Debug)]
pub struct Update {
    pub p: usize,
    pub g: usize,
    pub m: usize,
    pub v: usize,
    pub p_out: usize,
    pub m_out: usize,
    pub v_out: usize,
    pub len: usize,
}

/// The per-step scalars, as the decomposition computes them in f32.
#[derive(Clone, Copy, Debug)]
pub struct Scalars {
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    eps: f32,
    decay: f32,
    step_size: f32,
    sqrt_bc2: f32,
}

impl Scalars {
    /// From the learning rate, the step count `t` and the hyperparameters.
    pub fn new(lr: f32, t: f32, beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> Scalars {
        // `1 - beta^t`: the decomposition's `(beta^t · -1) + 1`, the same rounding.
        let bc1 = 1.0 - (beta1 as f32).powf(t);
        let bc2 = 1.0 - (beta2 as f32).powf(t);
        Scalars {
            b1: beta1 as f32,
            one_minus_b1: (1.0 - beta1) as f32,
            b2: beta2 as f32,
            one_minus_b2: (1.0 - beta2) as f32,
            eps: eps as f32,
            decay: lr * (-weight_decay) as f32 + 1.0,
            step_size: lr / bc1,
            sqrt_bc2: bc2.sqrt(),
        }
    }
}

/// Elements per task: large enough that a task's setup is noise, small enough that both cores
/// get several tasks from a 500K-element parameter.
const CHUNK: usize = 1 << 15;

/// Applies every update.
///
/// # Safety
/// `base` is the arena and every range of `updates` lies in it. An output may be exactly its
/// own input (in place); otherwise no output overlaps any input or other output.
pub unsafe fn step(base: *mut f32, updates: &[Update], s: Scalars) {
    let arena = TaskPtr(base);
    // (update, first element) of every chunk.
    let chunks: Vec<(usize, usize)> = updates
        .iter()
        .enumerate()
        .flat_map(|(k, u)| (0..u.len).step_by(CHUNK).map(move |e| (k, e)))
        .collect();
    Pool::current().run(chunks.len(), &|c| {
        let (k, start) = chunks[c];
        let u = updates[k];
        let end = (start + CHUNK).min(u.len);
        let mut i = start;
        while i < end {
            let n = BLOCK.min(end - i);
            // SAFETY: the caller's contract; elements `i..i + n` of this update belong to this
            // task, and each is read before it is written.
            unsafe { block(arena, &u, i, n, &s) };
            i += n;
        }
    });
}

/// Elements moved through local arrays at a time. An output may be its own input, so the
/// arena itself cannot be handed out as non-overlapping slices; copies into locals let the
/// arithmetic (two divisions and a square root per element) vectorize.
const BLOCK: usize = 64;

/// Elements `i..i + n` of `u`.
///
/// # Safety
/// As for `step`; `n <= BLOCK`.
#[inline(always)]
unsafe fn block(arena: Arena, u: &Update, i: usize, n: usize, s: &Scalars) {
    let load = |at: usize, dst: &mut [f32; BLOCK]| {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(arena.at(at + i), dst.as_mut_ptr(), n) };
    };
    let (mut p, mut g, mut m, mut v) =
        ([0.0f32; BLOCK], [0.0f32; BLOCK], [0.0; BLOCK], [0.0; BLOCK]);
    load(u.p, &mut p);
    load(u.g, &mut g);
    load(u.m, &mut m);
    load(u.v, &mut v);
    for j in 0..BLOCK {
        let m1 = m[j] * s.b1 + g[j] * s.one_minus_b1;
        let v1 = v[j] * s.b2 + g[j] * g[j] * s.one_minus_b2;
        let update = (s.step_size * m1) / (v1.sqrt() / s.sqrt_bc2 + s.eps);
        p[j] = p[j] * s.decay - update;
        m[j] = m1;
        v[j] = v1;
    }
    let store = |at: usize, src: &[f32; BLOCK]| {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), arena.at(at + i), n) };
    };
    store(u.p_out, &p);
    store(u.m_out, &m);
    store(u.v_out, &v);
}
