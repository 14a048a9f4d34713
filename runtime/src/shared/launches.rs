//! The kernel launches of a Program's map, copy and reduce steps, with every argument resolved:
//! arena offsets, strides, vector width and how many units share the work. The cpu and the
//! device backends launch the same kernels (`kernels.rs`) from these; they differ only in their
//! `Grid`.

use crate::shared::kernel_call::KernelCall;
use crate::shared::kernels::{
    two_byte_bit, GUARD_OPS, MODE_FULL, MODE_INNER, MODE_OUTER, MODE_SCALAR, ON_ROW_SHIFT,
    OUT_TWO_BYTE, REDUCE_HALVES, REDUCE_MAX, REDUCE_OUTER, REDUCE_SUM,
};
use crate::RuntimeError;
use graphtrain_ir::ValueId;
use graphtrain_lowering::program::collapse;
use graphtrain_lowering::{Access, Program, ReduceKind, ReduceOver, Step, View};

/// The longest row a copy unit takes (see `copy_calls`).
const COPY_ROW: usize = 4096;

/// How a backend splits kernels.
#[derive(Clone, Copy, Debug)]
pub struct Grid {
    /// The widest vector a map or column reduction reads (8 on AVX2, 4 on wgpu).
    pub vector: usize,
    /// The vector a plain map (no reduction) reads where every operand allows it: `vector` or
    /// a multiple of it (16 on a cpu with AVX-512). Each lane computes the same arithmetic at
    /// any width, so only speed depends on it; reductions keep `vector`, whose lanes are their
    /// order of sums.
    pub map_vector: usize,
    /// Units for a launch over `work` outputs, given the size below which the cpu backend
    /// keeps a launch on one thread (`small`).
    pub units: fn(work: usize, small: usize) -> u32,
    /// Whether map kernels must guard every op from the shader compiler (`GUARD_OPS`).
    pub guard_ops: bool,
}

impl Grid {
    fn units(&self, work: usize, small: usize) -> u32 {
        (self.units)(work, small)
    }
}

/// A `map_kernel` launch: `(width, units, modes, expr)`, the six input offsets and broadcast
/// parameters, then `[base, l, out, len]` (see `map_kernel`).
fn map_call(
    (width, units, modes, expr): (usize, u32, u32, &graphtrain_lowering::Expr),
    offsets: [usize; 6],
    params: [usize; 6],
    [base, l, out, len]: [usize; 4],
) -> KernelCall {
    let (o, p) = (offsets, params);
    KernelCall::Map {
        width,
        units,
        modes,
        expr: expr.clone(),
        args: [
            o[0],
            o[1],
            o[2],
            o[3],
            o[4],
            o[5],
            p[0],
            p[1],
            p[2],
            p[3],
            p[4],
            p[5],
            base,
            width,
            width.trailing_zeros() as usize,
            l,
            out,
            len,
        ],
    }
}

/// A Program's launches on one backend's grid.
pub struct Launches<'a> {
    pub program: &'a Program,
    pub grid: Grid,
}

impl Launches<'_> {
    /// The kernel launches of a map, copy or reduce step; `None` for the other steps.
    pub fn kernel_calls(&self, step: &Step) -> Result<Option<Vec<KernelCall>>, RuntimeError> {
        let mut calls = Vec::new();
        match step {
            Step::Map {
                out,
                len,
                inputs,
                expr,
            } => self.map_calls(*out, *len, inputs, expr, &mut calls)?,
            Step::Copy { dst, src } => {
                if src.numel() > 0 {
                    let dims = collapse(&src.shape, &[&src.strides, &dst.strides]);
                    self.copy_calls(
                        &dims,
                        self.program.elem_offset(src.base) + src.offset,
                        self.program.elem_offset(dst.base) + dst.offset,
                        &mut calls,
                    );
                }
            }
            Step::Reduce {
                kind,
                out,
                src,
                out_rank,
            } => self.reduce_calls(*kind, *out, src, *out_rank, &mut calls)?,
            Step::MapReduce {
                kind,
                over,
                out,
                outer,
                inner,
                inputs,
                expr,
            } => self.map_reduce_calls(
                (*kind, *over),
                *out,
                (*outer, *inner),
                inputs,
                expr,
                &mut calls,
            )?,
            _ => return Ok(None),
        }
        Ok(Some(calls))
    }

    fn map_calls(
        &self,
        out: ValueId,
        len: usize,
        inputs: &[graphtrain_lowering::MapInput],
        expr: &graphtrain_lowering::Expr,
        calls: &mut Vec<KernelCall>,
    ) -> Result<(), RuntimeError> {
        let (offs, params, mut modes, row_len, vectorizable) = self.map_modes(inputs);
        let out_off = self.program.elem_offset(out);
        let out_two_byte = self.program.is_two_byte(out);
        if out_two_byte {
            modes |= OUT_TWO_BYTE;
        }
        let vector = self.map_width(inputs, &offs, out_off, len, out_two_byte);
        // Whole wide vectors first, then whole vectors of the grid's width, then the tail
        // (len % self.grid.vector) with a width-1 launch of the same kernel. A width-1 launch
        // may round differently from a vector lane (its `exp` is not the vectors'), so the tail
        // is the same elements at every map width.
        let (wide, body) = if vectorizable {
            (
                len / vector * vector,
                len / self.grid.vector * self.grid.vector,
            )
        } else {
            (0, 0)
        };
        let mut push = |width: usize, start: usize, count: usize| {
            if count == 0 {
                return;
            }
            // Full inputs are addressed in vectors from `start` (in 4-byte slots where stored
            // in 2 bytes: `start` is a whole number of vectors, so even); the others in
            // elements.
            let o = |k: usize| {
                if modes & two_byte_bit(k) != 0 {
                    offs[k] + start / 2
                } else if (modes >> (2 * k)) & 3 == MODE_FULL {
                    (offs[k] + start) / width
                } else {
                    offs[k]
                }
            };
            // An output stored in 2 bytes is written a pair of vectors to one vector of slots
            // (`map_store_two_byte`): the lowering chose it only with a length of whole pairs.
            let out_vector = if out_two_byte {
                (out_off + start / 2) / width
            } else {
                (out_off + start) / width
            };
            calls.push(map_call(
                (width, self.grid.units(count, 4096), modes, expr),
                [o(0), o(1), o(2), o(3), o(4), o(5)],
                params,
                [start, row_len, out_vector, count / width],
            ));
        };
        if out_two_byte && (!len.is_multiple_of(2 * vector) || !out_off.is_multiple_of(vector)) {
            return Err(RuntimeError::Backend(format!(
                "a map writing {len} bf16 elements in 2 bytes at slot {out_off}: not whole pairs \
of {vector}-lane vectors"
            )));
        }
        push(vector, 0, wide);
        push(self.grid.vector, wide, body - wide);
        push(1, body, len - body);
        Ok(())
    }

    /// The vector width of a plain map: the grid's `map_vector` where every full or
    /// inner-broadcast operand and the output start on a whole vector of it (in 4-byte slots),
    /// every broadcast's period is whole vectors of it and a 2-byte output is whole pairs of
    /// them; else the grid's `vector`, which the lowering guarantees.
    fn map_width(
        &self,
        inputs: &[graphtrain_lowering::MapInput],
        offs: &[usize; 6],
        out_off: usize,
        len: usize,
        out_two_byte: bool,
    ) -> usize {
        let wide = self.grid.map_vector;
        let fits = wide > self.grid.vector
            && out_off.is_multiple_of(wide)
            && (!out_two_byte || len.is_multiple_of(2 * wide))
            && inputs.iter().zip(offs).all(|(i, &o)| match i.access {
                Access::Full | Access::Inner { .. } if !o.is_multiple_of(wide) => false,
                Access::Outer { inner: p } | Access::Inner { period: p } => p.is_multiple_of(wide),
                Access::Full | Access::Scalar => true,
            });
        if fits {
            wide
        } else {
            self.grid.vector
        }
    }

    /// The map kernel in its reducing form (`REDUCE_*`), at the grid's vector width: rows are a
    /// multiple of 8 long (the lowering's `BROADCAST_ALIGN`), as is every broadcast period, so
    /// the elements are computed in the same vectors as the eager map's.
    fn map_reduce_calls(
        &self,
        (kind, over): (ReduceKind, ReduceOver),
        out: ValueId,
        (outer, inner): (usize, usize),
        inputs: &[graphtrain_lowering::MapInput],
        expr: &graphtrain_lowering::Expr,
        calls: &mut Vec<KernelCall>,
    ) -> Result<(), RuntimeError> {
        let width = self.grid.vector;
        let out_off = self.program.elem_offset(out);
        let (offs, params, mut modes, _, vectorizable) = self.map_modes(inputs);
        // Inner: each block of eight elements is one vector of 8 lanes or two of 4, to keep
        // `reduce_kernel`'s eight partials.
        let halves = match (over, width) {
            (ReduceOver::Outer, _) | (ReduceOver::Inner, 8) => false,
            (ReduceOver::Inner, 4) => true,
            _ => {
                return Err(RuntimeError::Backend(format!(
                    "a reduction over rows fused with its producer needs vectors of 4 or 8 lanes, this backend uses {width}"
                )))
            }
        };
        if !vectorizable || !inner.is_multiple_of(width) || !out_off.is_multiple_of(width) {
            return Err(RuntimeError::Backend(format!(
                "fused reduction of {outer} x {inner} elements does not split into whole vectors of {width}"
            )));
        }
        // On-row inputs read the broadcast element (outer access) or column (inner access) of
        // the element's row: exactly those whose period is the row length.
        modes &= !(0x3f << ON_ROW_SHIFT);
        for (k, &p) in params.iter().enumerate().take(inputs.len()) {
            if matches!((modes >> (2 * k)) & 3, MODE_OUTER | MODE_INNER) && p == inner {
                modes |= 1 << (ON_ROW_SHIFT + k as u32);
            }
        }
        modes |= match kind {
            ReduceKind::Sum => REDUCE_SUM,
            ReduceKind::Max => REDUCE_MAX,
        };
        if halves {
            modes |= REDUCE_HALVES;
        }
        if over == ReduceOver::Outer {
            modes |= REDUCE_OUTER;
        }
        let o = |k: usize| {
            if modes & two_byte_bit(k) != 0 {
                offs[k]
            } else if (modes >> (2 * k)) & 3 == MODE_FULL {
                offs[k] / width
            } else {
                offs[k]
            }
        };
        // Units split the outputs (a unit past the last output has nothing to do).
        let units = self.grid.units(outer * inner, 4096);
        calls.push(map_call(
            (width, units, modes, expr),
            [o(0), o(1), o(2), o(3), o(4), o(5)],
            params,
            [0, inner, out_off / width, outer],
        ));
        Ok(())
    }

    /// Offsets, broadcast parameters and access modes of a map's inputs; the row length the
    /// on-row inputs share; and whether the map can run in whole vectors.
    fn map_modes(
        &self,
        inputs: &[graphtrain_lowering::MapInput],
    ) -> ([usize; 6], [usize; 6], u32, usize, bool) {
        let mut offs = [0usize; 6];
        let mut params = [1usize; 6];
        let mut modes = 0u32;
        // Broadcast reads stay vectorized only when a vector never straddles two source
        // elements (outer) or two periods (inner); otherwise the whole map runs at width 1.
        // The lowering only forms broadcasts whose period is a multiple of `BROADCAST_ALIGN`
        // (= self.grid.vector), so that the split, and with it the rounding, matches eager.
        let mut vectorizable = true;
        for (k, i) in inputs.iter().enumerate() {
            offs[k] = self.program.elem_offset(i.value);
            let mode = match i.access {
                Access::Full if self.program.is_two_byte(i.value) => {
                    modes |= two_byte_bit(k);
                    MODE_FULL
                }
                Access::Full => MODE_FULL,
                Access::Scalar => MODE_SCALAR,
                Access::Outer { inner } => {
                    params[k] = inner;
                    vectorizable &= inner % self.grid.vector == 0;
                    MODE_OUTER
                }
                Access::Inner { period } => {
                    params[k] = period;
                    vectorizable &= period % self.grid.vector == 0;
                    MODE_INNER
                }
            };
            modes |= mode << (2 * k);
        }
        // The row length: the first broadcast input's parameter; every broadcast input with the
        // same parameter reads from the kernel's running row/column instead of dividing.
        let row_len = inputs.iter().enumerate().find_map(|(k, _)| {
            matches!((modes >> (2 * k)) & 3, MODE_OUTER | MODE_INNER).then_some(params[k])
        });
        if let Some(l) = row_len {
            for (k, &p) in params.iter().enumerate().take(inputs.len()) {
                if matches!((modes >> (2 * k)) & 3, MODE_OUTER | MODE_INNER) && p == l {
                    modes |= 1 << (ON_ROW_SHIFT + k as u32);
                }
            }
        }
        let row_len = row_len.unwrap_or(1);
        if self.grid.guard_ops {
            modes |= GUARD_OPS;
        }
        (offs, params, modes, row_len, vectorizable)
    }

    /// One launch for up to four strided dims; more are peeled off on the host, one launch per
    /// index of the outermost dim.
    fn copy_calls(
        &self,
        dims: &[(usize, Vec<usize>)],
        src: usize,
        dst: usize,
        calls: &mut Vec<KernelCall>,
    ) {
        // A unit copies whole rows of the innermost dim: a long one is cut into rows of
        // `COPY_ROW`, the rest of it copied by a call of its own, so that the units share the
        // work (a contiguous copy is one row) and none loops past lavapipe's limit (see
        // `kernels::LOOP_BUDGET`).
        if let Some((n, st)) = dims.last().filter(|(n, _)| *n > COPY_ROW) {
            let (rows, rest) = (n / COPY_ROW, n % COPY_ROW);
            let outer = &dims[..dims.len() - 1];
            let mut cut = outer.to_vec();
            cut.push((rows, vec![st[0] * COPY_ROW, st[1] * COPY_ROW]));
            cut.push((COPY_ROW, st.clone()));
            self.copy_calls(&cut, src, dst, calls);
            if rest > 0 {
                let mut tail = outer.to_vec();
                tail.push((rest, st.clone()));
                let done = rows * COPY_ROW;
                self.copy_calls(&tail, src + done * st[0], dst + done * st[1], calls);
            }
            return;
        }
        if dims.len() > 4 {
            let (n, st) = &dims[0];
            for i in 0..*n {
                self.copy_calls(&dims[1..], src + i * st[0], dst + i * st[1], calls);
            }
            return;
        }
        let len: usize = dims.iter().map(|d| d.0).product();
        let mut n = [1usize; 4];
        let mut s = [0usize; 4];
        let mut t = [0usize; 4];
        let pad = 4 - dims.len();
        for (d, (size, st)) in dims.iter().enumerate() {
            n[pad + d] = *size;
            s[pad + d] = st[0];
            t[pad + d] = st[1];
        }
        calls.push(KernelCall::Copy {
            units: self.grid.units(len, 4096),
            args: [
                len, n[1], n[2], n[3], s[0], s[1], s[2], s[3], t[0], t[1], t[2], t[3], src, dst,
            ],
        });
    }

    fn reduce_calls(
        &self,
        kind: ReduceKind,
        out: ValueId,
        src: &View,
        out_rank: usize,
        calls: &mut Vec<KernelCall>,
    ) -> Result<(), RuntimeError> {
        let (keep_shape, red_shape) = src.shape.split_at(out_rank);
        let (keep_st, red_st) = src.strides.split_at(out_rank);
        let keep = collapse(keep_shape, &[keep_st]);
        let red = collapse(red_shape, &[red_st]);
        if keep.len() > 3 || red.len() > 2 {
            return Err(RuntimeError::Backend(format!(
                "reduce of {:?} keeping {out_rank} dims needs more strided dims than the kernel walks",
                src.shape
            )));
        }
        let len: usize = keep_shape.iter().product();
        if len == 0 {
            return Ok(());
        }
        let mut n = [1usize; 3];
        let mut s = [0usize; 3];
        for (d, (size, st)) in keep.iter().enumerate() {
            n[3 - keep.len() + d] = *size;
            s[3 - keep.len() + d] = st[0];
        }
        let mut m = [1usize; 2];
        let mut q = [0usize; 2];
        for (d, (size, st)) in red.iter().enumerate() {
            m[2 - red.len() + d] = *size;
            q[2 - red.len() + d] = st[0];
        }
        // An empty reduction (a zero-sized reduced dim) yields the identity.
        if red_shape.contains(&0) {
            m = [0, 1];
        }
        let rows = m[0] == 1 && q[1] == 1;
        let (src_off, out_off) = (
            self.program.elem_offset(src.base) + src.offset,
            self.program.elem_offset(out),
        );
        // Outputs contiguous along the inner kept dim, reduced over outer dims: whole vectors
        // of outputs at once when every offset and stride is in whole vectors.
        let by_vectors = !rows
            && s[2] == 1
            && n[2] % self.grid.vector == 0
            && [src_off, out_off, s[0], s[1], q[0], q[1]]
                .iter()
                .all(|x| x % self.grid.vector == 0);
        let width = if by_vectors { self.grid.vector } else { 1 };
        calls.push(KernelCall::Reduce {
            width,
            units: self.grid.units(len, 64),
            is_max: kind == ReduceKind::Max,
            rows,
            args: [
                len / width,
                n[1],
                n[2] / width,
                s[0] / width,
                s[1] / width,
                if by_vectors { 1 } else { s[2] },
                m[0],
                m[1],
                q[0] / width,
                q[1] / width,
                src_off / width,
                out_off / width,
            ],
        });
        Ok(())
    }
}
