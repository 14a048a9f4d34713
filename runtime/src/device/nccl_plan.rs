//! How one of graphtrain's collectives runs on NCCL's: which NCCL operation, and the block
//! swaps around it that turn graphtrain's layouts into NCCL's.
//!
//! NCCL concatenates and splits along the leading dimension only (an all-gather puts member
//! `i`'s bytes at `i · count`; a reduce-scatter gives member `i` the sum of everyone's `i`-th
//! `count`), while graphtrain's collectives name any axis. Around axis `a` of shape `s`, a
//! tensor is `[outer, len, inner]` with `outer = Π s[..a]`; where `outer` is 1 the layouts agree
//! and the collective runs in place of the arena. Elsewhere a `Swap` (a `[rows, cols, chunk]`
//! to `[cols, rows, chunk]` block transpose, run as strided 2-D copies on NCCL's stream)
//! packs the operand into scratch before NCCL, or unpacks its result after.
//!
//! The plan is pure arithmetic, so its tests run everywhere: they execute plans with NCCL's
//! operations emulated on the host and compare every member's result with `comm::combine`,
//! the threads engine's definition of each collective. What they cannot check is NCCL itself
//! (its sums run in its ring's order, so results agree with the threads engine within
//! rounding, not bit for bit).

use graphtrain_ir::{Collective, Reduce};

/// `[rows, cols, chunk]` read contiguous from `src` and written as `[cols, rows, chunk]`
/// contiguous to `dst`: `dst[(c · rows + r) · chunk ..] = src[(r · cols + c) · chunk ..]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    pub rows: usize,
    pub cols: usize,
    pub chunk: usize,
}

impl Swap {
    /// Applies the swap on the host (the tests' reference for the device's strided copies).
    pub fn apply(&self, src: &[f32], dst: &mut [f32]) {
        let Swap { rows, cols, chunk } = *self;
        for r in 0..rows {
            for c in 0..cols {
                let from = (r * cols + c) * chunk;
                let to = (c * rows + r) * chunk;
                dst[to..to + chunk].copy_from_slice(&src[from..from + chunk]);
            }
        }
    }
}

/// The NCCL operation, on `count` elements per member block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclOp {
    /// `ncclAllReduce` of `count` elements.
    AllReduce { reduce: Reduce },
    /// `ncclAllGather`: `count` sent, `members · count` received.
    AllGather,
    /// `ncclReduceScatter`: `members · count` sent, `count` received.
    ReduceScatter { reduce: Reduce },
    /// `ncclBroadcast` of `count` elements from member `root`.
    Broadcast { root: usize },
    /// One `ncclSend` and one `ncclRecv` per member in a group call: block `j` of the
    /// `members · count` sent goes to member `j`; block `i` received came from member `i`.
    AllToAll,
}

/// One collective as NCCL runs it: pack (into scratch), the operation, unpack (out of scratch
/// into the result), then a rounding of the result to bf16 where the collective sums bf16.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclPlan {
    pub op: NcclOp,
    /// Elements per member block (see `NcclOp`).
    pub count: usize,
    pub pack: Option<Swap>,
    pub unpack: Option<Swap>,
    pub round_bf16: bool,
    /// Elements the operand and the result take.
    pub src_len: usize,
    pub dst_len: usize,
}

impl NcclPlan {
    /// The plan of `collective` over `members` ranks, on an operand of shape `src_shape`.
    pub fn new(
        collective: Collective,
        members: usize,
        src_shape: &[usize],
        round_bf16: bool,
    ) -> NcclPlan {
        let n = members;
        let numel: usize = src_shape.iter().product();
        // (outer, len, inner) of `shape` around `axis`.
        let split = |shape: &[usize], axis: usize| {
            let outer: usize = shape[..axis].iter().product();
            let inner: usize = shape[axis + 1..].iter().product();
            (outer, shape[axis], inner)
        };
        let swap = |rows: usize, cols: usize, chunk: usize| {
            (rows > 1 && cols > 1 && chunk > 0).then_some(Swap { rows, cols, chunk })
        };
        let plan = |op, count, pack, unpack, dst_len| NcclPlan {
            op,
            count,
            pack,
            unpack,
            round_bf16: round_bf16
                && matches!(op, NcclOp::AllReduce { .. } | NcclOp::ReduceScatter { .. }),
            src_len: numel,
            dst_len,
        };
        match collective {
            Collective::AllReduce { reduce } => {
                plan(NcclOp::AllReduce { reduce }, numel, None, None, numel)
            }
            Collective::Broadcast { root } => {
                plan(NcclOp::Broadcast { root }, numel, None, None, numel)
            }
            Collective::AllGather { axis } => {
                // Received as [members, outer, len·inner]; the result is [outer, members, ..].
                let (outer, len, inner) = split(src_shape, axis);
                let unpack = swap(n, outer, len * inner);
                plan(NcclOp::AllGather, numel, None, unpack, n * numel)
            }
            Collective::ReduceScatter { axis, reduce } => {
                // The operand [outer, members, block] packed as [members, outer, block].
                let (outer, len, inner) = split(src_shape, axis);
                let block = len / n * inner;
                let pack = swap(outer, n, block);
                plan(
                    NcclOp::ReduceScatter { reduce },
                    outer * block,
                    pack,
                    None,
                    outer * block,
                )
            }
            Collective::AllToAll {
                split_axis,
                concat_axis,
            } => {
                // Packed by destination as `ReduceScatter` packs; received by sender as
                // [members, part], unpacked around `concat_axis` of a part as `AllGather`.
                let (outer, len, inner) = split(src_shape, split_axis);
                let block = len / n * inner;
                let mut part = src_shape.to_vec();
                part[split_axis] /= n;
                let (c_outer, c_len, c_inner) = split(&part, concat_axis);
                plan(
                    NcclOp::AllToAll,
                    outer * block,
                    swap(outer, n, block),
                    swap(n, c_outer, c_len * c_inner),
                    numel,
                )
            }
        }
    }

    /// Elements of scratch the plan needs: where the packed operand goes, and where the
    /// operation's result lands before its unpacking.
    pub fn scratch_lens(&self) -> (usize, usize) {
        (
            if self.pack.is_some() { self.src_len } else { 0 },
            if self.unpack.is_some() {
                self.dst_len
            } else {
                0
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{combine, CollectiveCall};

    /// Every member's result of `plan`, with NCCL's operations emulated on the host (sums in
    /// member order, as `combine` adds them).
    fn run_emulated(plan: &NcclPlan, operands: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let n = operands.len();
        let sent: Vec<Vec<f32>> = operands
            .iter()
            .map(|x| match plan.pack {
                Some(s) => {
                    let mut packed = vec![f32::NAN; x.len()];
                    s.apply(x, &mut packed);
                    packed
                }
                None => x.clone(),
            })
            .collect();
        let c = plan.count;
        let reduce = |at: usize, len: usize, how: Reduce| -> Vec<f32> {
            let mut out = sent[0][at..at + len].to_vec();
            for m in &sent[1..] {
                for (o, s) in out.iter_mut().zip(&m[at..at + len]) {
                    *o += *s;
                }
            }
            if how == Reduce::Avg {
                out.iter_mut().for_each(|o| *o /= n as f32);
            }
            out
        };
        (0..n)
            .map(|me| {
                let received: Vec<f32> = match plan.op {
                    NcclOp::AllReduce { reduce: how } => reduce(0, c, how),
                    NcclOp::ReduceScatter { reduce: how } => reduce(me * c, c, how),
                    NcclOp::AllGather => sent.iter().flat_map(|m| m[..c].to_vec()).collect(),
                    NcclOp::Broadcast { root } => sent[root][..c].to_vec(),
                    NcclOp::AllToAll => sent
                        .iter()
                        .flat_map(|m| m[me * c..(me + 1) * c].to_vec())
                        .collect(),
                };
                let mut out = match plan.unpack {
                    Some(s) => {
                        let mut unpacked = vec![f32::NAN; plan.dst_len];
                        s.apply(&received, &mut unpacked);
                        unpacked
                    }
                    None => received,
                };
                assert_eq!(out.len(), plan.dst_len, "{plan:?}");
                if plan.round_bf16 {
                    out.iter_mut()
                        .for_each(|x| *x = graphtrain_ir::host_tensor::round_bf16(*x));
                }
                out
            })
            .collect()
    }

    /// What `combine` (the threads engine) gives member `me`.
    fn reference(
        collective: Collective,
        shape: &[usize],
        operands: &[Vec<f32>],
        me: usize,
        dst_len: usize,
        round_bf16: bool,
    ) -> Vec<f32> {
        let n = operands.len();
        let mut dst = vec![f32::NAN; dst_len];
        let call = CollectiveCall {
            id: 0,
            collective,
            mesh_dims: vec![0],
            group: (0..n).collect(),
            member: me,
            src: operands[me].as_ptr(),
            src_shape: shape.to_vec(),
            dst: dst.as_mut_ptr(),
            dst_len,
            round_bf16,
        };
        let pointers: Vec<*const f32> = operands.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: every operand holds `shape`'s element count; `dst` holds `dst_len`.
        unsafe { combine(&call, &pointers) };
        dst
    }

    #[test]
    fn every_collective_on_every_axis_matches_the_threads_engine() {
        let shapes: [&[usize]; 4] = [&[12], &[4, 6], &[2, 6, 4], &[6, 2, 2, 3]];
        let mut checked = 0;
        for n in [2usize, 3] {
            for shape in shapes {
                let numel: usize = shape.iter().product();
                // Distinct values per member and position, not exactly representable in bf16.
                let operands: Vec<Vec<f32>> = (0..n)
                    .map(|m| {
                        (0..numel)
                            .map(|i| (m * 1000 + i) as f32 * 1.001 + 0.3)
                            .collect()
                    })
                    .collect();
                let mut collectives = vec![
                    Collective::AllReduce {
                        reduce: Reduce::Sum,
                    },
                    Collective::AllReduce {
                        reduce: Reduce::Avg,
                    },
                    Collective::Broadcast { root: n - 1 },
                ];
                for axis in 0..shape.len() {
                    collectives.push(Collective::AllGather { axis });
                    if shape[axis] % n == 0 {
                        collectives.push(Collective::ReduceScatter {
                            axis,
                            reduce: Reduce::Sum,
                        });
                        for concat_axis in 0..shape.len() {
                            collectives.push(Collective::AllToAll {
                                split_axis: axis,
                                concat_axis,
                            });
                        }
                    }
                }
                for collective in collectives {
                    for round_bf16 in [false, true] {
                        // A bf16 collective's operands hold bf16 values: moving them keeps
                        // them so, and only sums (not bf16 in general) need the rounding.
                        let operands: Vec<Vec<f32>> = operands
                            .iter()
                            .map(|o| {
                                o.iter()
                                    .map(|&x| {
                                        if round_bf16 {
                                            graphtrain_ir::host_tensor::round_bf16(x)
                                        } else {
                                            x
                                        }
                                    })
                                    .collect()
                            })
                            .collect();
                        let plan = NcclPlan::new(collective, n, shape, round_bf16);
                        let got = run_emulated(&plan, &operands);
                        for (me, got) in got.iter().enumerate() {
                            let want = reference(
                                collective,
                                shape,
                                &operands,
                                me,
                                plan.dst_len,
                                round_bf16,
                            );
                            let same = got
                                .iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(
                                same,
                                "{collective:?} over {n} on {shape:?} (bf16 {round_bf16}), \
member {me}: {got:?} against {want:?} ({plan:?})"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 300, "only {checked} cases ran");
    }

    #[test]
    fn a_leading_axis_runs_in_place_and_others_swap_through_scratch() {
        let gather = NcclPlan::new(Collective::AllGather { axis: 0 }, 4, &[2, 8], false);
        assert_eq!((gather.pack, gather.unpack), (None, None));
        assert_eq!(gather.scratch_lens(), (0, 0));
        let gather = NcclPlan::new(Collective::AllGather { axis: 1 }, 4, &[2, 8], false);
        assert_eq!(
            gather.unpack,
            Some(Swap {
                rows: 4,
                cols: 2,
                chunk: 8
            })
        );
        assert_eq!(gather.scratch_lens(), (0, 64));
        let scatter = NcclPlan::new(
            Collective::ReduceScatter {
                axis: 1,
                reduce: Reduce::Sum,
            },
            4,
            &[2, 8],
            true,
        );
        assert_eq!(
            (scatter.pack, scatter.count, scatter.round_bf16),
            (
                Some(Swap {
                    rows: 2,
                    cols: 4,
                    chunk: 2
                }),
                4,
                true
            )
        );
        // Moving bf16 values leaves them bf16: only sums round.
        assert!(!NcclPlan::new(Collective::AllGather { axis: 0 }, 2, &[4], true).round_bf16);
    }
}
