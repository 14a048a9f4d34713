//! Rotary embedding on the cpu backend as one host step: the decomposition's two slices, two
//! broadcast tables, four products and concat become one pass over the rows.
//!
//! Numerics: the angle tables are computed exactly as `graphtrain_ir::decompose` builds them (in
//! f64: `freq_i = theta^(i · -2/D)`, `angle = pos · freq`, negated for `inverse`, then `cos` and
//! `sin` cast to f32), and each output is `x1·cos - x2·sin` or `x1·sin + x2·cos` in f32, two
//! roundings for the products and one for the sum, as the decomposed kernels do.

use super::pool::{Pool, TaskPtr};
use crate::shared::rope_tables::Tables;
use graphtrain_ir::RopeLayout;

/// A rank-4 `[B, S, H, D]` input: element offset and strides, in 4-byte slots, or in 2-byte
/// halves where `halves` (bf16 stored in 2 bytes, `Program::is_two_byte`).
#[derive(Clone, Copy, Debug)]
pub struct Input {
    pub offset: usize,
    pub shape: [usize; 4],
    pub strides: [usize; 4],
    pub halves: bool,
}

/// One head of the `Half` layout with contiguous elements: the same products and sums as the
/// general loop, over slices, so they vectorize (the element-by-element loop ran at 4 ns per
/// element).
#[inline(always)]
fn rotate_halves(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = out.split_at_mut(half);
    for i in 0..half {
        o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
        o2[i] = x1[i] * sin[i] + x2[i] * cos[i];
    }
}

/// One contiguous head in either layout.
#[inline(always)]
fn rotate(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], layout: RopeLayout) {
    if layout == RopeLayout::Half {
        return rotate_halves(x, out, cos, sin);
    }
    for i in 0..cos.len() {
        let (x1, x2) = (x[2 * i], x[2 * i + 1]);
        out[2 * i] = x1 * cos[i] - x2 * sin[i];
        out[2 * i + 1] = x1 * sin[i] + x2 * cos[i];
    }
}

/// `out` (contiguous `[B, S, H, D]` at element offset `out`) = rope of `x`.
///
/// # Safety
/// `base` is the arena; `x` and `out` lie inside it and do not overlap.
pub unsafe fn apply(base: *mut f32, x: Input, out: usize, layout: RopeLayout, t: &Tables) {
    // Tasks write disjoint rows of the output and only read the input.
    let arena = TaskPtr(base);
    let [b, s, h, d] = x.shape;
    let half = d / 2;
    let rows = b * s;
    let pool = Pool::current();
    let tasks = (pool.width() * 4).min(rows.max(1));
    pool.run(tasks, &|task| {
        // A head stored in 2 bytes, widened: read from memory at half the bytes, rotated from
        // here as a contiguous head.
        let mut widened = vec![0f32; if x.halves { d } else { 0 }];
        for row in rows * task / tasks..rows * (task + 1) / tasks {
            let (bi, pos) = (row / s, row % s);
            let (cos, sin) = (
                &t.cos[pos * half..(pos + 1) * half],
                &t.sin[pos * half..(pos + 1) * half],
            );
            for hi in 0..h {
                let src = x.offset + bi * x.strides[0] + pos * x.strides[1] + hi * x.strides[2];
                let dst = out + (row * h + hi) * d;
                if x.halves {
                    let head = (arena.0 as *const u16).wrapping_add(src);
                    for (j, w) in widened.iter_mut().enumerate() {
                        // SAFETY: the head's `d` elements are in the arena (the caller's
                        // contract).
                        *w = unsafe { super::bf16_pack::widen(head, j * x.strides[3]) };
                    }
                    // SAFETY: as below.
                    let os = unsafe { std::slice::from_raw_parts_mut(arena.at(dst), d) };
                    rotate(&widened, os, cos, sin, layout);
                    continue;
                }
                if layout == RopeLayout::Half && x.strides[3] == 1 {
                    // SAFETY: in the arena by the caller's contract, input and output apart;
                    // rows are split between tasks.
                    let (xs, os) = unsafe {
                        (
                            std::slice::from_raw_parts(arena.at(src), d),
                            std::slice::from_raw_parts_mut(arena.at(dst), d),
                        )
                    };
                    rotate_halves(xs, os, cos, sin);
                    continue;
                }
                // Element `j` of this head's input and output.
                // SAFETY: as above.
                let at = |j: usize| unsafe { *arena.at(src + j * x.strides[3]) };
                let put = |j: usize, v: f32| unsafe { *arena.at(dst + j) = v };
                for i in 0..half {
                    let (j1, j2) = match layout {
                        RopeLayout::Half => (i, i + half),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x1, x2) = (at(j1), at(j2));
                    put(j1, x1 * cos[i] - x2 * sin[i]);
                    put(j2, x1 * sin[i] + x2 * cos[i]);
                }
            }
        }
    });
}
