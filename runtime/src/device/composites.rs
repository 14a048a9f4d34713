//! The device backends' kernels for the composites the lowering keeps as one step each
//! (`lowering::program::kept_composite`): rotary embedding, AdamW, cross-entropy and its
//! gradient, causal grouped-query attention and its gradient.
//!
//! Why: decomposed, attention materializes its `[B, H, S, S]` scores and probabilities in the
//! arena (on `peer` 305 MiB planned against 225), cross-entropy makes five passes over the
//! logits plus a one-hot, and AdamW one launch per output per parameter. Each kernel here is one
//! pass (two or three for the reductions) with nothing of that size stored.
//!
//! Like `kernels.rs`, every operand is a binding of its own (the arena's buffer that holds
//! it), addressed with element offsets passed at launch, and unit `u` of `U` takes outputs `u, u + U, ...`. Operands are strided
//! views (offset plus one stride per dim), so a transpose feeding a composite is read in place.
//! Some kernels need room of their own: the rope angle tables and the per-row statistics of
//! the reductions live in the arena's tail, past the index-check flag (`device.rs`).
//!
//! Numerics: each output is computed by one unit in a fixed order (sums over keys, classes or
//! query rows in index order; a group's query heads in ascending order), so the same Program
//! gives the same bits every run, and the eager and the fused lowerings, which keep the same
//! composites, give the same bits. The arithmetic follows `graphtrain_ir::decompose` and the
//! cpu host steps in formula, not in rounding: these kernels agree with the interpreter within
//! f32 rounding, not bit for bit with the cpu backend.
//!
//! What is not done yet: one unit per output row with no shared-memory tiling; correct, not
//! fast, as the rest of the device backends.

use super::kernels::rounded;
use cubecl::prelude::*;

/// Rotary embedding: for every `[B, S, H]` head and pair `(x1, x2)` of its `D` elements (`Half`:
/// elements `i` and `i + D/2`; interleaved: `2i` and `2i + 1`), `y1 = x1·cos - x2·sin`,
/// `y2 = x1·sin + x2·cos` with the angle tables at `cos` and `sin` (`[S, D/2]` each, built on
/// the host in f64 as the decomposition builds them). `x` is a strided view, the output
/// contiguous `[B, S, H, D]` at `out`. One unit per pair.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn rope_kernel(
    x_buf: &mut [f32],
    out_buf: &mut [f32],
    tables: &mut [f32],
    x: usize,
    x0: usize,
    x1: usize,
    x2: usize,
    x3: usize,
    out: usize,
    cos: usize,
    sin: usize,
    seq: usize,
    heads: usize,
    half: usize,
    interleaved: u32,
    total: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let i = e % half;
        let t = e / half;
        let h = t % heads;
        let row = t / heads;
        let pos = row % seq;
        let b = row / seq;
        let mut j1 = i;
        let mut j2 = i + half;
        if interleaved == 1 {
            j1 = 2 * i;
            j2 = 2 * i + 1;
        }
        let src = x + b * x0 + pos * x1 + h * x2;
        let a = x_buf[src + j1 * x3];
        let c = x_buf[src + j2 * x3];
        let co = tables[cos + pos * half + i];
        let si = tables[sin + pos * half + i];
        let dst = out + t * 2 * half;
        out_buf[dst + j1] = a * co - c * si;
        out_buf[dst + j2] = a * si + c * co;
        e += units;
    }
}

/// One AdamW update of `n` elements, `p`, `g`, `m`, `v` into `p_out`, `m_out`, `v_out` (each
/// either its own input, in place, or apart from every operand). The learning rate and the bias
/// corrections `[bc1, sqrt(bc2)]` are read from the arena (`lr`, `corrections`), so a
/// recorded launch reads each step's; the hyperparameters come as the f32 the decomposition
/// uses (`1 - beta` computed in f64 on the host). Per element, as `graphtrain_ir::decompose`:
/// `m' = m·b1 + g·(1 - b1)`, `v' = v·b2 + (g·g)·(1 - b2)`,
/// `p' = p·(lr·(-wd) + 1) - ((lr / bc1)·m') / (sqrt(v') / sqrt(bc2) + eps)` with
/// `bc = 1 - beta^t`, which the host computes (in f32, as the cpu backend does) and writes.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn adamw_kernel(
    p_buf: &mut [f32],
    g_buf: &mut [f32],
    m_buf: &mut [f32],
    v_buf: &mut [f32],
    p_out_buf: &mut [f32],
    m_out_buf: &mut [f32],
    v_out_buf: &mut [f32],
    lr_buf: &mut [f32],
    corrections_buf: &mut [f32],
    p: usize,
    g: usize,
    m: usize,
    v: usize,
    p_out: usize,
    m_out: usize,
    v_out: usize,
    lr: usize,
    corrections: usize,
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    eps: f32,
    neg_weight_decay: f32,
    n: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let rate = lr_buf[lr];
    let bc1 = corrections_buf[corrections];
    let sqrt_bc2 = corrections_buf[corrections + 1];
    let decay = rate * neg_weight_decay + f32::new(1.0);
    let step_size = rate / bc1;
    let mut e = ABSOLUTE_POS;
    while e < n {
        let gi = g_buf[g + e];
        let m1 = m_buf[m + e] * b1 + gi * one_minus_b1;
        let v1 = v_buf[v + e] * b2 + gi * gi * one_minus_b2;
        let update = (step_size * m1) / (f32::sqrt(v1) / sqrt_bc2 + eps);
        let p1 = p_buf[p + e] * decay - update;
        p_out_buf[p_out + e] = p1;
        m_out_buf[m_out + e] = m1;
        v_out_buf[v_out + e] = v1;
        e += units;
    }
}

/// Per row `r` of the `[rows, cols]` logits view `x` (row stride `xr`, column stride `xc`):
/// `mx = max_j x_j` and `s = Σ_j exp(x_j - mx)`, into `stats[2r]` and `stats[2r + 1]`. When
/// `targets` is set (`with_loss == 1`), also `loss_r = (mx + ln s) - x_t` into
/// `losses[r]`, `t` read from the targets view (stride `ts`; checked beforehand).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_rows_kernel(
    x_buf: &mut [f32],
    targets_buf: &mut [f32],
    stats_buf: &mut [f32],
    losses_buf: &mut [f32],
    x: usize,
    xr: usize,
    xc: usize,
    targets: usize,
    ts: usize,
    stats: usize,
    losses: usize,
    with_loss: u32,
    cols: usize,
    rows: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut r = ABSOLUTE_POS;
    while r < rows {
        let row = x + r * xr;
        let mut mx = x_buf[row];
        for j in 1..cols {
            mx = max(mx, x_buf[row + j * xc]);
        }
        let mut s = f32::new(0.0);
        for j in 0..cols {
            s += f32::exp(x_buf[row + j * xc] - mx);
        }
        stats_buf[stats + 2 * r] = mx;
        stats_buf[stats + 2 * r + 1] = s;
        if with_loss == 1 {
            let t = usize::cast_from(targets_buf[targets + r * ts]);
            losses_buf[losses + r] = (mx + f32::ln(s)) - x_buf[row + t * xc];
        }
        r += units;
    }
}

/// `out = (Σ_r losses[r]) / rows`, the rows summed in order by one unit.
#[cube(launch_unchecked)]
pub fn mean_kernel(
    losses_buf: &mut [f32],
    out_buf: &mut [f32],
    losses: usize,
    out: usize,
    rows: usize,
) {
    if ABSOLUTE_POS == 0 {
        let mut total = f32::new(0.0);
        for r in 0..rows {
            total += losses_buf[losses + r];
        }
        out_buf[out] = total / f32::cast_from(rows);
    }
}

/// Cross-entropy's gradient into the contiguous `[rows, cols]` output at `out`:
/// `(exp(x_j - mx) / s - [j == t]) · (g / rows)`, with each row's `mx` and `s` from
/// `cross_entropy_rows_kernel` at `stats` and the upstream gradient `g` read at `grad`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward_kernel(
    x_buf: &mut [f32],
    targets_buf: &mut [f32],
    stats_buf: &mut [f32],
    grad_buf: &mut [f32],
    out_buf: &mut [f32],
    x: usize,
    xr: usize,
    xc: usize,
    targets: usize,
    ts: usize,
    stats: usize,
    grad: usize,
    out: usize,
    cols: usize,
    total: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let rows = total / cols;
    let scale = grad_buf[grad] / f32::cast_from(rows);
    let mut e = ABSOLUTE_POS;
    while e < total {
        let j = e % cols;
        let r = e / cols;
        let mx = stats_buf[stats + 2 * r];
        let s = stats_buf[stats + 2 * r + 1];
        let p = f32::exp(x_buf[x + r * xr + j * xc] - mx) / s;
        let t = usize::cast_from(targets_buf[targets + r * ts]);
        let mut hot = f32::new(0.0);
        if j == t {
            hot = f32::new(1.0);
        }
        out_buf[out + e] = (p - hot) * scale;
        e += units;
    }
}

/// A `[B, H, S, D]` operand of the attention kernels: the element offset of `[0, 0, 0, 0]` in
/// the arena and one stride per dim (an output's rows are contiguous, `s3 == 1`).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct Heads4 {
    pub at: usize,
    pub s0: usize,
    pub s1: usize,
    pub s2: usize,
    pub s3: usize,
}

#[cube]
impl Heads4 {
    /// Element offset of row `i` of head `h` in batch `b`.
    fn row(&self, b: usize, h: usize, i: usize) -> usize {
        self.at + b * self.s0 + h * self.s1 + i * self.s2
    }
}

/// The attention kernels' shape: `heads` query heads in groups of `group` per kv head, `seq`
/// rows each; `causal == 1` masks keys after the query row; `round_bf16 == 1` (bf16 attention,
/// `Step::Attention`) rounds each operand element to bf16 as it is read, the probabilities and
/// score gradients before the products that read them, and each output element as it is final,
/// around an f32 computation like f32 attention's. The head's width `d` is a comptime
/// argument of each kernel instead: its loops over a head's elements unroll, so a unit's loop
/// trips are its keys' (lavapipe's budget, `shared::kernels::LOOP_BUDGET`), not keys x `d`.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub group: usize,
    pub seq: usize,
    pub causal: u32,
    pub scale: f32,
    pub round_bf16: u32,
}

/// Query row `e` of `[B, H, S, D]`: its batch, head, row, kv head, and how many keys it sees.
#[derive(CubeType, Clone, Copy)]
struct QueryRow {
    b: usize,
    h: usize,
    i: usize,
    kvh: usize,
    keys: usize,
}

#[cube]
impl AttentionShape {
    fn query_row(&self, e: usize) -> QueryRow {
        let i = e % self.seq;
        let t = e / self.seq;
        let h = t % self.heads;
        let mut keys = self.seq;
        if self.causal == 1 {
            keys = i + 1;
        }
        QueryRow {
            b: t / self.heads,
            h,
            i,
            kvh: h / self.group,
            keys,
        }
    }
}

/// The score `(q_i · k_j) · scale` of query row `q` (element stride `qd`) against key row `k`
/// (element stride `kd`) over `d` elements, each element rounded to bf16 as it is read where
/// `round == 1` (bf16 attention, whose operands may be f32 a fused cast left unrounded).
#[cube]
#[allow(clippy::too_many_arguments)]
fn score(
    q_buf: &mut [f32],
    q: usize,
    qd: usize,
    k_buf: &mut [f32],
    k: usize,
    kd: usize,
    scale: f32,
    round: u32,
    #[comptime] d: usize,
) -> f32 {
    let mut dot = f32::new(0.0);
    #[unroll]
    for x in 0..d {
        dot += rounded(q_buf[q + x * qd], round) * rounded(k_buf[k + x * kd], round);
    }
    dot * scale
}

/// A softmax row's statistics: its largest score and `Σ exp(s - max)`.
#[derive(CubeType, Clone, Copy)]
struct Softmax {
    max: f32,
    sum: f32,
}

/// The softmax statistics of query row `q`'s scores against the first `keys` rows of `k`
/// (row stride `kr`), in one pass over the keys: the sum is kept relative to the largest score
/// so far and rescaled by `exp(old - new)` when a larger one comes, so each score (a dot
/// product over the head) is computed once here instead of once for the max and again for the
/// sum.
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_stats(
    q_buf: &mut [f32],
    q: usize,
    qd: usize,
    k_buf: &mut [f32],
    k: usize,
    kr: usize,
    kd: usize,
    keys: usize,
    scale: f32,
    round: u32,
    #[comptime] d: usize,
) -> Softmax {
    let mut mx = score(q_buf, q, qd, k_buf, k, kd, scale, round, d);
    let mut sum = f32::new(1.0);
    for j in 1..keys {
        let s = score(q_buf, q, qd, k_buf, k + j * kr, kd, scale, round, d);
        if s > mx {
            sum = sum * f32::exp(mx - s) + f32::new(1.0);
            mx = s;
        } else {
            sum += f32::exp(s - mx);
        }
    }
    Softmax { max: mx, sum }
}

/// Attention forward, `out_i = Σ_j softmax_j((q_i · k_j) · scale) v_j` over the keys `j`
/// (`j ≤ i` when `causal == 1`), one unit per query row of `[B, H, S, D]` (`total = B·H·S`);
/// query head `h` reads kv head `h / (H / Hkv)`. The output's rows are contiguous. The
/// unnormalized sum is accumulated in the output row, then divided by the softmax's sum.
/// With `stats`, the row's softmax max and sum go to `s_buf[s_at + 2e ..]` (`[B, H, S, 2]`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_kernel(
    q_buf: &mut [f32],
    k_buf: &mut [f32],
    v_buf: &mut [f32],
    o_buf: &mut [f32],
    s_buf: &mut [f32],
    q: Heads4,
    k: Heads4,
    v: Heads4,
    o: Heads4,
    s_at: usize,
    shape: AttentionShape,
    total: usize,
    #[comptime] d: usize,
    #[comptime] stats: bool,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let r = shape.query_row(e);
        let scale = shape.scale;
        let keys = r.keys;
        let qi = q.row(r.b, r.h, r.i);
        let kb = k.row(r.b, r.kvh, 0);
        let vb = v.row(r.b, r.kvh, 0);
        let oi = o.row(r.b, r.h, r.i);
        let round = shape.round_bf16;
        let stats_i = softmax_stats(
            q_buf, qi, q.s3, k_buf, kb, k.s2, k.s3, keys, scale, round, d,
        );
        let mx = stats_i.max;
        let sum = stats_i.sum;
        if comptime!(stats) {
            s_buf[s_at + 2 * e] = mx;
            s_buf[s_at + 2 * e + 1] = sum;
        }
        #[unroll]
        for x in 0..d {
            o_buf[oi + x] = f32::new(0.0);
        }
        // f32 sums unnormalized weights and divides once; bf16 attention's product reads each
        // probability rounded to bf16 (the cpu's and torch's bf16 attention), so it normalizes
        // first.
        for j in 0..keys {
            let mut p =
                f32::exp(score(q_buf, qi, q.s3, k_buf, kb + j * k.s2, k.s3, scale, round, d) - mx);
            if round == 1 {
                p = rounded(p / sum, round);
            }
            #[unroll]
            for x in 0..d {
                o_buf[oi + x] += p * rounded(v_buf[vb + j * v.s2 + x * v.s3], round);
            }
        }
        #[unroll]
        for x in 0..d {
            let mut o = o_buf[oi + x];
            if round == 0 {
                o /= sum;
            }
            o_buf[oi + x] = rounded(o, round);
        }
        e += units;
    }
}

/// Attention backward, first half: one unit per query row (as `attention_kernel`). With
/// `p_j = softmax_j(s_j)` and `dp_j = dout_i · v_j`, it stores the row's softmax max, sum and
/// `δ = Σ_j p_j dp_j` at `stats + 3e` for `attention_kv_backward_kernel`, and writes
/// `dq_i = (Σ_j p_j (dp_j - δ) k_j) · scale` (accumulated in the output row). With `given`,
/// the max and sum are the forward's (`attention_kernel`'s `stats`, at `f_buf[f_at + 2e ..]`)
/// instead of a pass over the keys of its own.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_dq_kernel(
    q_buf: &mut [f32],
    k_buf: &mut [f32],
    v_buf: &mut [f32],
    g_buf: &mut [f32],
    dq_buf: &mut [f32],
    stats_buf: &mut [f32],
    f_buf: &mut [f32],
    q: Heads4,
    k: Heads4,
    v: Heads4,
    g: Heads4,
    dq: Heads4,
    stats: usize,
    f_at: usize,
    shape: AttentionShape,
    total: usize,
    #[comptime] d: usize,
    #[comptime] given: bool,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let r = shape.query_row(e);
        let scale = shape.scale;
        let keys = r.keys;
        let qi = q.row(r.b, r.h, r.i);
        let gi = g.row(r.b, r.h, r.i);
        let kb = k.row(r.b, r.kvh, 0);
        let vb = v.row(r.b, r.kvh, 0);
        let di = dq.row(r.b, r.h, r.i);
        let round = shape.round_bf16;
        let stats_i = if comptime!(given) {
            Softmax {
                max: f_buf[f_at + 2 * e],
                sum: f_buf[f_at + 2 * e + 1],
            }
        } else {
            softmax_stats(
                q_buf, qi, q.s3, k_buf, kb, k.s2, k.s3, keys, scale, round, d,
            )
        };
        let mx = stats_i.max;
        let sum = stats_i.sum;
        let mut delta = f32::new(0.0);
        for j in 0..keys {
            let p =
                f32::exp(score(q_buf, qi, q.s3, k_buf, kb + j * k.s2, k.s3, scale, round, d) - mx)
                    / sum;
            delta += p * score(
                g_buf,
                gi,
                g.s3,
                v_buf,
                vb + j * v.s2,
                v.s3,
                f32::new(1.0),
                round,
                d,
            );
        }
        stats_buf[stats + 3 * e] = mx;
        stats_buf[stats + 3 * e + 1] = sum;
        stats_buf[stats + 3 * e + 2] = delta;
        #[unroll]
        for x in 0..d {
            dq_buf[di + x] = f32::new(0.0);
        }
        for j in 0..keys {
            let p =
                f32::exp(score(q_buf, qi, q.s3, k_buf, kb + j * k.s2, k.s3, scale, round, d) - mx)
                    / sum;
            let dp = score(
                g_buf,
                gi,
                g.s3,
                v_buf,
                vb + j * v.s2,
                v.s3,
                f32::new(1.0),
                round,
                d,
            );
            let ds = rounded(p * (dp - delta), round);
            #[unroll]
            for x in 0..d {
                dq_buf[di + x] += ds * rounded(k_buf[kb + j * k.s2 + x * k.s3], round);
            }
        }
        #[unroll]
        for x in 0..d {
            dq_buf[di + x] = rounded(dq_buf[di + x] * scale, round);
        }
        e += units;
    }
}

/// Attention backward, second half: one unit per key row of `[B, Hkv, S, D]` (`total =
/// B·Hkv·S`), one launch per query head of the group (`member`, in ascending order): over the
/// query rows `i` of that head that see key `j`, in order, with the row statistics of
/// `attention_dq_kernel`: `dv_j = Σ p_ij dout_i` and `dk_j = (Σ p_ij (dp_ij - δ_i) q_i) · scale`.
/// The sums accumulate in the output rows, so the launches add in the order one loop over the
/// group would (the first zeroes the rows, the last scales `dk`), and a unit's loop trips are
/// one head's, not the group's (lavapipe's budget: `shared::kernels::LOOP_BUDGET`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn attention_kv_backward_kernel(
    q_buf: &mut [f32],
    k_buf: &mut [f32],
    v_buf: &mut [f32],
    g_buf: &mut [f32],
    dk_buf: &mut [f32],
    dv_buf: &mut [f32],
    stats_buf: &mut [f32],
    q: Heads4,
    k: Heads4,
    v: Heads4,
    g: Heads4,
    dk: Heads4,
    dv: Heads4,
    stats: usize,
    shape: AttentionShape,
    member: usize,
    total: usize,
    #[comptime] d: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let heads = shape.heads;
    let group = shape.group;
    let seq = shape.seq;
    let scale = shape.scale;
    let round = shape.round_bf16;
    let kv_heads = heads / group;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let j = e % seq;
        let t = e / seq;
        let kvh = t % kv_heads;
        let b = t / kv_heads;
        let kj = k.row(b, kvh, j);
        let vj = v.row(b, kvh, j);
        let dkj = dk.row(b, kvh, j);
        let dvj = dv.row(b, kvh, j);
        if member == 0 {
            #[unroll]
            for x in 0..d {
                dk_buf[dkj + x] = f32::new(0.0);
                dv_buf[dvj + x] = f32::new(0.0);
            }
        }
        let mut first = 0;
        if shape.causal == 1 {
            first = j;
        }
        let h = kvh * group + member;
        for i in first..seq {
            let qi = q.row(b, h, i);
            let gi = g.row(b, h, i);
            let row = stats + 3 * ((b * heads + h) * seq + i);
            let p =
                f32::exp(score(q_buf, qi, q.s3, k_buf, kj, k.s3, scale, round, d) - stats_buf[row])
                    / stats_buf[row + 1];
            let dp = score(g_buf, gi, g.s3, v_buf, vj, v.s3, f32::new(1.0), round, d);
            // bf16 attention's products read `p` and `ds` rounded (`ds` from the f32 `p`).
            let ds = rounded(p * (dp - stats_buf[row + 2]), round);
            let p = rounded(p, round);
            #[unroll]
            for x in 0..d {
                dv_buf[dvj + x] += p * rounded(g_buf[gi + x * g.s3], round);
                dk_buf[dkj + x] += ds * rounded(q_buf[qi + x * q.s3], round);
            }
        }
        if member + 1 == group {
            #[unroll]
            for x in 0..d {
                dk_buf[dkj + x] = rounded(dk_buf[dkj + x] * scale, round);
                dv_buf[dvj + x] = rounded(dv_buf[dvj + x], round);
            }
        }
        e += units;
    }
}
