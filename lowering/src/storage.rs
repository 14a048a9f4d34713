//! bf16 values stored in 2 bytes: which values of a Program a backend keeps as bf16's own bits
//! instead of in f32 slots, and the arena planned again for them.
//!
//! Contract of `Program::store_bf16_in_two_bytes`:
//! - changes: `Program::bf16_in_two_bytes` marks the chosen values, and the arena is planned
//!   again with 2 bytes per element for them (`Program::value_bytes`);
//! - guarantees: the steps and every other value's storage are unchanged, so results are
//!   bit for bit those of the f32 slots (a bf16 value is an f32 whose low 16 bits are zero:
//!   the high half holds all of it); a chosen value starts, like every buffer, on
//!   `ARENA_ALIGN`, so element `i` is the `i`-th 2-byte half from there, in the order of its
//!   contiguous layout;
//! - chooses only what every step that touches the value can read or write in halves today: a
//!   bf16 value written by one step, a `Matmul` (its bf16-rounded result) or a `Map` whose
//!   expression ends in `RoundBf16`, and read only by `Map` and `MapReduce` steps, whole
//!   (`Access::Full`), by `Matmul`s as an operand (through any view: the GEMM packs pairs of
//!   halves as it packs pairs of rounded floats), by rope (widened a head at a time) and by
//!   cross-entropy and its gradient as logits (a row at a time), with a length that is a whole
//!   number of
//!   `2 * BROADCAST_ALIGN` elements (the map kernel's vectors, in pairs);
//! - declines every other value, which stays in an f32 slot: graph inputs and outputs (the
//!   host reads and writes those as f32), constants, values read by layout steps or
//!   attention, broadcast reads, collectives' operands and results, and offloaded
//!   values. Widening the set means teaching those steps halves.
//!
//! Why: a bf16 product written into f32 slots moves twice the bytes it holds, and the step's
//! GEMMs and maps run near their memory rate (docs/benchmarks.md): `peer`'s feed-forward
//! products alone are 6 MiB each in f32 slots.

use crate::program::{Access, Expr, Program, Step, BROADCAST_ALIGN, ELEM_BYTES};
use graphtrain_ir::{DType, ValueId};

/// Bytes of one element of a value stored as bf16.
pub const BF16_BYTES: usize = 2;

impl Program {
    /// Stores in 2 bytes the bf16 values whose producer and readers all take halves (see the
    /// module's contract) and plans the arena again. Returns how many values it chose.
    pub fn store_bf16_in_two_bytes(&mut self) -> usize {
        let chosen = two_byte_values(self);
        let count = chosen.iter().filter(|c| **c).count();
        if count == 0 {
            return 0;
        }
        self.bf16_in_two_bytes = chosen;
        self.plan_again(None)
            .expect("a plan without windows always places every buffer");
        count
    }

    /// Whether `v` is stored as bf16 in 2 bytes per element (else in a 4-byte slot).
    pub fn is_two_byte(&self, v: ValueId) -> bool {
        self.bf16_in_two_bytes
            .get(v.index())
            .copied()
            .unwrap_or(false)
    }

    /// Bytes `v`'s buffer holds.
    pub fn value_bytes(&self, v: ValueId) -> usize {
        let per = if self.is_two_byte(v) {
            BF16_BYTES
        } else {
            ELEM_BYTES
        };
        self.graph.ty(v).numel() * per
    }
}

/// Per value, whether it can be stored in 2 bytes (the module's contract).
fn two_byte_values(p: &Program) -> Vec<bool> {
    let g = &p.graph;
    let n = g.values.len();
    let mut writers = vec![0usize; n];
    let mut candidate = vec![false; n];
    for s in &p.steps {
        for o in s.outputs() {
            writers[o.index()] += 1;
        }
        let written_as_bf16 = match s {
            Step::Matmul { out, bf16, .. } => Some((*out, bf16.out)),
            Step::Map { out, expr, .. } => Some((*out, matches!(expr, Expr::RoundBf16(_)))),
            _ => None,
        };
        if let Some((out, rounded)) = written_as_bf16 {
            let numel = g.ty(out).numel();
            candidate[out.index()] = rounded
                && g.ty(out).dtype == DType::BF16
                && numel > 0
                && numel.is_multiple_of(2 * BROADCAST_ALIGN);
        }
    }
    for v in g
        .inputs
        .iter()
        .map(|i| i.value)
        .chain(g.outputs.iter().map(|o| o.value))
        .chain(p.constants.iter().map(|(v, _)| *v))
        .chain(p.host_values.iter().copied())
    {
        candidate[v.index()] = false;
    }
    for s in &p.steps {
        match s {
            Step::Map { inputs, .. } | Step::MapReduce { inputs, .. } => {
                for i in inputs {
                    if i.access != Access::Full {
                        candidate[i.value.index()] = false;
                    }
                }
            }
            // Operands of any view; rope's input head by head, widened.
            Step::Matmul { .. } | Step::Rope { .. } => {}
            // The logits, widened row by row; the targets are integers.
            Step::CrossEntropy { targets, .. } | Step::CrossEntropyBackward { targets, .. } => {
                candidate[targets.base.index()] = false;
                if let Step::CrossEntropyBackward { grad, .. } = s {
                    candidate[grad.index()] = false;
                }
            }
            other => {
                for v in other.reads() {
                    candidate[v.index()] = false;
                }
            }
        }
    }
    (0..n).map(|v| candidate[v] && writers[v] == 1).collect()
}
