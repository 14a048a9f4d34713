//! Batches from real text: a token stream (documents joined by the end-of-text id) cut into rows
//! of `seq_len + 1` tokens (stride `seq_len + 1`, no overlap; the tail too short for a row is
//! dropped). Each row gives `seq_len` inputs and the same tokens shifted by one as targets.
//!
//! Split: the last `val_fraction` of rows (at least one) are held out for validation; every
//! other row is for training. Training batch `k` is a pure function of `(seed, k)`: positions
//! `k * batch ..` walk through epochs, each a Fisher-Yates shuffle of the training rows seeded by
//! `(seed, epoch)`; so the data position is the number of batches consumed, and a resumed run
//! sees exactly the batches the uninterrupted run would have. Validation batches are the held-out
//! rows in order.
//!
//! Refuses: a text shorter than one training row plus one validation row (saying how many tokens
//! there are and how many are needed), a `val_fraction` outside (0, 1) or one that leaves no
//! training row, a batch asked with another `seq_len` than the rows were cut for, and validation
//! batches when the held-out rows do not fill one batch.

use super::tokens::TokenFile;
use super::Batch;
use graphtrain_ir::rng;
use std::sync::{Arc, Mutex};

/// Stream id of the row shuffle, apart from the random-token and parameter-init streams.
const SHUFFLE_STREAM: u64 = 0x5EED_5A3F;
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;

/// A shuffle kept for reuse: (seed, epoch, the permutation of training rows).
type CachedShuffle = (u64, u64, Arc<Vec<u32>>);

pub struct TextData {
    tokens: TokenFile,
    seq_len: usize,
    val_fraction: f64,
    train_rows: usize,
    val_rows: usize,
    /// The last epoch's permutation: consecutive batches mostly fall in the same epoch.
    shuffle: Mutex<Option<CachedShuffle>>,
}

impl std::fmt::Debug for TextData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TextData({}, seq_len {}, train rows {}, val rows {})",
            self.identity(),
            self.seq_len,
            self.train_rows,
            self.val_rows
        )
    }
}

impl TextData {
    /// Cuts `tokens` into rows for a model of sequence length `seq_len` and splits off the last
    /// `val_fraction` of rows.
    pub fn new(tokens: TokenFile, seq_len: usize, val_fraction: f64) -> Result<TextData, String> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(format!(
                "the validation fraction must lie strictly between 0 and 1, got {val_fraction}"
            ));
        }
        if seq_len == 0 {
            return Err("seq_len must be at least 1".to_string());
        }
        let row = seq_len + 1;
        let rows = tokens.len() / row;
        if rows < 2 {
            return Err(format!(
                "the text has {} tokens; with seq_len {seq_len} a row is {row} tokens and one training row plus one validation row need {} tokens",
                tokens.len(),
                2 * row
            ));
        }
        let val_rows = ((rows as f64 * val_fraction).floor() as usize).max(1);
        let train_rows = rows.saturating_sub(val_rows);
        if train_rows == 0 {
            return Err(format!(
                "a validation fraction of {val_fraction} leaves none of the {rows} rows for training"
            ));
        }
        if train_rows > u32::MAX as usize {
            return Err(format!(
                "{train_rows} training rows: more than the shuffle indexes (2^32)"
            ));
        }
        Ok(TextData {
            tokens,
            seq_len,
            val_fraction,
            train_rows,
            val_rows,
            shuffle: Mutex::new(None),
        })
    }

    /// What identifies this data in a checkpoint: the texts, the tokenizer and the split.
    pub fn identity(&self) -> String {
        format!(
            "text:{:016x}:{:016x}:{}",
            self.tokens.header.source_fingerprint,
            self.tokens.header.tokenizer_fingerprint,
            self.val_fraction
        )
    }

    pub fn tokens(&self) -> &TokenFile {
        &self.tokens
    }
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
    pub fn train_rows(&self) -> usize {
        self.train_rows
    }
    pub fn val_rows(&self) -> usize {
        self.val_rows
    }
    /// One more than the largest id the tokens may hold.
    pub fn vocab_size(&self) -> usize {
        self.tokens.header.vocab_size as usize
    }

    /// Epoch `epoch`'s order of the training rows under `seed`: a permutation of
    /// `0..train_rows`.
    pub fn shuffle(&self, seed: u64, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.shuffle.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, e, perm)) = cache.as_ref() {
            if *s == seed && *e == epoch {
                return perm.clone();
            }
        }
        let stream = SHUFFLE_STREAM ^ rng::mix64(epoch);
        let mut perm: Vec<u32> = (0..self.train_rows as u32).collect();
        for i in (1..perm.len()).rev() {
            let j = rng::below(seed, stream, i as u64, i as u64 + 1) as usize;
            perm.swap(i, j);
        }
        let perm = Arc::new(perm);
        *cache = Some((seed, epoch, perm.clone()));
        perm
    }

    /// Inputs and targets of row `row`, appended.
    fn push_row(&self, row: usize, out: &mut Batch) {
        let start = row * (self.seq_len + 1);
        for i in 0..self.seq_len {
            out.tokens.push(self.tokens.get(start + i) as i64);
            out.targets.push(self.tokens.get(start + i + 1) as i64);
        }
    }

    fn check_seq(&self, seq: usize) -> Result<(), String> {
        if seq != self.seq_len {
            return Err(format!(
                "the text was cut into rows for seq_len {}, the batch asks for {seq}",
                self.seq_len
            ));
        }
        Ok(())
    }

    /// Training batch `k` (0-based) of `batch` rows.
    pub fn train_batch(
        &self,
        seed: u64,
        k: u64,
        batch: usize,
        seq: usize,
    ) -> Result<Batch, String> {
        self.train_rows_of(seed, k, batch, 0..batch, seq)
    }

    /// Rows `rows` of training batch `k` of `batch` rows: what `train_batch` gives for them,
    /// reading only those rows of the text.
    pub fn train_rows_of(
        &self,
        seed: u64,
        k: u64,
        batch: usize,
        rows: std::ops::Range<usize>,
        seq: usize,
    ) -> Result<Batch, String> {
        self.check_seq(seq)?;
        let mut out = Batch {
            tokens: Vec::with_capacity(rows.len() * seq),
            targets: Vec::with_capacity(rows.len() * seq),
        };
        let n = self.train_rows as u64;
        for b in rows.start as u64..rows.end as u64 {
            let position = k
                .checked_mul(batch as u64)
                .and_then(|p| p.checked_add(b))
                .ok_or_else(|| format!("batch {k} lies beyond 2^64 rows"))?;
            let perm = self.shuffle(seed, position / n);
            self.push_row(perm[(position % n) as usize] as usize, &mut out);
        }
        Ok(out)
    }

    /// The held-out rows in order, `batch` at a time; the last partial batch is dropped (so
    /// `val_rows() % batch` rows are not used).
    pub fn val_batches(&self, batch: usize) -> Result<Vec<Batch>, String> {
        if batch == 0 || self.val_rows < batch {
            return Err(format!(
                "the validation split holds {} rows of {} tokens, fewer than one batch of {batch}: use more text or a larger validation fraction",
                self.val_rows,
                self.seq_len + 1
            ));
        }
        Ok((0..self.val_rows / batch)
            .map(|i| {
                let mut out = Batch {
                    tokens: Vec::with_capacity(batch * self.seq_len),
                    targets: Vec::with_capacity(batch * self.seq_len),
                };
                for r in 0..batch {
                    self.push_row(self.train_rows + i * batch + r, &mut out);
                }
                out
            })
            .collect())
    }
}
