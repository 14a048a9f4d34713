//! View algebra: layout ops (reshape, transpose, slice, expand) as strided reads of a value
//! already in memory, so that fused lowering reads in place where eager lowering copies.
//!
//! Every function is pure and its view walks the same elements in the same order as the op
//! would produce them. Where one view cannot express the op (a reshape that merges dims which
//! are not contiguous with each other, a matmul operand whose batch dims do not collapse into
//! one stride, a broadcast no single `Access` describes) the function returns `None` and the
//! caller materializes a copy instead.

use crate::program::{Access, View};

/// Merges adjacent dims that are contiguous with each other in every operand.
pub fn collapse(shape: &[usize], strides: &[&[usize]]) -> Vec<(usize, Vec<usize>)> {
    let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let st: Vec<usize> = strides.iter().map(|s| s[d]).collect();
        if let Some((n, prev)) = out.last_mut() {
            if prev.iter().zip(&st).all(|(p, s)| *p == s * shape[d]) {
                *n *= shape[d];
                *prev = st;
                continue;
            }
        }
        out.push((shape[d], st));
    }
    out
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

pub fn transpose_view(v: &View, perm: &[usize]) -> View {
    View {
        base: v.base,
        offset: v.offset,
        shape: perm.iter().map(|&p| v.shape[p]).collect(),
        strides: perm.iter().map(|&p| v.strides[p]).collect(),
    }
}

pub fn expand_view(v: &View, shape: &[usize]) -> View {
    View {
        base: v.base,
        offset: v.offset,
        shape: shape.to_vec(),
        strides: v
            .shape
            .iter()
            .zip(&v.strides)
            .map(|(&d, &s)| if d == 1 { 0 } else { s })
            .collect(),
    }
}

pub fn slice_view(v: &View, axis: usize, start: usize, len: usize) -> View {
    let mut s = v.clone();
    s.offset += start * v.strides[axis];
    s.shape[axis] = len;
    s
}

/// A reshape of a view as one strided view, when the split/merged dims allow it.
pub fn reshape_view(v: &View, shape: &[usize]) -> Option<View> {
    if v.is_contiguous() {
        return Some(View::contiguous(v.base, shape));
    }
    // Walk both shapes, matching groups of equal element counts; a group of source dims must be
    // mergeable (contiguous among themselves) to be re-split.
    let src: Vec<(usize, usize)> = v
        .shape
        .iter()
        .zip(&v.strides)
        .filter(|(d, _)| **d != 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    let mut strides = vec![0; shape.len()];
    let (mut i, mut j) = (0, 0);
    while j < shape.len() {
        if shape[j] == 1 {
            j += 1;
            continue;
        }
        if i >= src.len() {
            return None;
        }
        // Grow a group until the counts match.
        let (mut sn, mut dn) = (src[i].0, shape[j]);
        let (i0, j0) = (i, j);
        while sn != dn {
            if sn < dn {
                i += 1;
                if i >= src.len() {
                    return None;
                }
                if src[i - 1].1 != src[i].1 * src[i].0 {
                    return None;
                }
                sn *= src[i].0;
            } else {
                j += 1;
                if j >= shape.len() {
                    return None;
                }
                dn *= shape[j];
            }
        }
        // The group's innermost stride, re-split over destination dims j0..=j.
        let mut stride = src[i].1;
        for d in (j0..=j).rev() {
            strides[d] = stride;
            stride *= shape[d];
        }
        let _ = i0;
        i += 1;
        j += 1;
    }
    if i != src.len() {
        return None;
    }
    Some(View {
        base: v.base,
        offset: v.offset,
        shape: shape.to_vec(),
        strides,
    })
}

/// `[..batch, r, c]` as `[batch, r, c]` (a rank-2 view is shared: batch stride 0).
pub(crate) fn as_batched(v: &View, batch: usize) -> Option<View> {
    let r = v.shape.len();
    if r == 2 {
        return Some(View {
            base: v.base,
            offset: v.offset,
            shape: vec![batch, v.shape[0], v.shape[1]],
            strides: vec![0, v.strides[0], v.strides[1]],
        });
    }
    let lead = View {
        base: v.base,
        offset: v.offset,
        shape: v.shape[..r - 2].to_vec(),
        strides: v.strides[..r - 2].to_vec(),
    };
    let (dims, strides) = lead.collapsed();
    let bs = match dims.len() {
        0 => 0,
        1 => strides[0],
        _ => return None,
    };
    Some(View {
        base: v.base,
        offset: v.offset,
        shape: vec![batch, v.shape[r - 2], v.shape[r - 1]],
        strides: vec![bs, v.strides[r - 2], v.strides[r - 1]],
    })
}

/// The broadcast an `expand` from `from` to `to` performs, when one `Access` expresses it.
pub(crate) fn expand_access(from: &[usize], to: &[usize]) -> Option<Access> {
    let kept = |d: usize| from[d] == to[d];
    let spread = |d: usize| from[d] == 1;
    let r = to.len();
    // Outer: kept dims first, then only broadcast (or unit) dims.
    if let Some(j) = (0..=r).find(|&j| (0..j).all(kept) && (j..r).all(spread)) {
        let inner: usize = to[j..].iter().product();
        if inner > 1 && from[..j].iter().product::<usize>() > 1 {
            return Some(Access::Outer { inner });
        }
    }
    // Inner: broadcast dims first, then only kept dims.
    if let Some(j) = (0..=r).find(|&j| (0..j).all(spread) && (j..r).all(kept)) {
        let period: usize = from.iter().product();
        if period > 1 && to[..j].iter().product::<usize>() > 1 {
            return Some(Access::Inner { period });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::ValueId;

    #[test]
    fn reshape_views_split_and_merge_strided_dims() {
        let v = View {
            base: ValueId(0),
            offset: 0,
            shape: vec![4, 6],
            strides: vec![1, 4],
        };
        // [4, 6] column-major -> [4, 2, 3]: the 6 splits into 2 x 3 with strides 12, 4.
        let r = reshape_view(&v, &[4, 2, 3]).unwrap();
        assert_eq!(r.strides, vec![1, 12, 4]);
        // Merging the transposed dims is impossible.
        assert!(reshape_view(&v, &[24]).is_none());
    }

    #[test]
    fn collapse_merges_contiguous_runs_only() {
        let c = collapse(&[2, 3, 4], &[&[12, 4, 1]]);
        assert_eq!(c, vec![(24, vec![1])]);
        let c = collapse(&[2, 3, 4], &[&[1, 8, 2]]);
        assert_eq!(c.len(), 2);
    }
}
