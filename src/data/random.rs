//! Synthetic token batches: seeded random tokens, the same batch every step (`fixed`) or a
//! fresh one per step (`random`). Pure functions of (seed, step), so runs are reproducible;
//! they need no files and serve the engine's own tests and benchmarks.

use super::Batch;
use graphtrain_ir::rng;

/// Stream id of the token generator, kept apart from the parameter-init streams.
const DATA_STREAM: u64 = 0xDA7A;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataMode {
    /// A fresh random batch every step.
    Random,
    /// Batch 0 at every step (memorization: the loss must fall fast).
    Fixed,
}

/// Batch `step` (0-based): `batch` rows of `seq + 1` random tokens, split into input and target.
pub fn batch(
    mode: DataMode,
    seed: u64,
    step: u64,
    batch: usize,
    seq: usize,
    vocab: usize,
) -> Batch {
    rows(mode, seed, step, batch, 0..batch, seq, vocab)
}

/// Rows `rows` of batch `step` of `batch` rows: what `batch` gives for them, without making
/// the others (each row is its own stretch of the stream).
pub fn rows(
    mode: DataMode,
    seed: u64,
    step: u64,
    batch: usize,
    rows: std::ops::Range<usize>,
    seq: usize,
    vocab: usize,
) -> Batch {
    let step = match mode {
        DataMode::Random => step,
        DataMode::Fixed => 0,
    };
    let row = seq + 1;
    let base = step * (batch * row) as u64;
    let mut tokens = Vec::with_capacity(rows.len() * seq);
    let mut targets = Vec::with_capacity(rows.len() * seq);
    for b in rows {
        let tok = |i: usize| {
            rng::below(seed, DATA_STREAM, base + (b * row + i) as u64, vocab as u64) as i64
        };
        for i in 0..seq {
            tokens.push(tok(i));
            targets.push(tok(i + 1));
        }
    }
    Batch { tokens, targets }
}
