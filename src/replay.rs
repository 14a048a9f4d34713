//! Replay files: a run's exact batches and initial weights, in the forms another framework
//! reads, so the same steps can be replayed there and the losses compared (the PyTorch peer's
//! `llama_step.py --batches FILE --init FILE.safetensors`).
//!
//! Batches: raw little-endian u32 token ids, one `[batch, seq + 1]` block per step trained, in
//! step order: each row is the step's input tokens plus the row's last target (targets are the
//! tokens shifted by one). A batch whose targets are not its tokens shifted by one cannot be
//! written this way and is refused, as are token ids that do not fit in u32: the file would
//! replay other data than was trained on.
//!
//! Initial weights: a safetensors file of every parameter under the graph's names (torchtitan's,
//! e.g. `layers.0.attention.wq.weight`, Linear weights `[out, in]`), F32. Parameters of another
//! dtype are refused rather than silently converted.

use crate::checkpoint::{tensor_bytes, to_safetensors, write_atomically};
use crate::data::Batch;
use graphtrain_ir::{DType, HostTensor};
use safetensors::Dtype;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `batch` as `rows` rows of `seq + 1` token ids (u32): each row's tokens and its last target.
/// Refuses a batch of the wrong size, targets that are not the tokens shifted by one, and ids
/// that do not fit in u32.
pub fn batch_rows(b: &Batch, rows: usize, seq: usize) -> Result<Vec<u32>, String> {
    if seq == 0 || b.tokens.len() != rows * seq || b.targets.len() != rows * seq {
        return Err(format!(
            "the batch has {} tokens and {} targets; [{rows}, {seq}] needs {} of each",
            b.tokens.len(),
            b.targets.len(),
            rows * seq
        ));
    }
    let id = |v: i64, row: usize, col: usize| {
        u32::try_from(v)
            .map_err(|_| format!("token id {v} at row {row}, column {col} is not a u32"))
    };
    let mut out = Vec::with_capacity(rows * (seq + 1));
    for row in 0..rows {
        let tokens = &b.tokens[row * seq..(row + 1) * seq];
        let targets = &b.targets[row * seq..(row + 1) * seq];
        for i in 0..seq - 1 {
            if targets[i] != tokens[i + 1] {
                return Err(format!(
                    "row {row}: target {i} is {} but token {} is {}: the targets are not the \
tokens shifted by one, so [batch, seq+1] blocks cannot hold this batch",
                    targets[i],
                    i + 1,
                    tokens[i + 1]
                ));
            }
        }
        for (col, &t) in tokens.iter().enumerate() {
            out.push(id(t, row, col)?);
        }
        out.push(id(targets[seq - 1], row, seq)?);
    }
    Ok(out)
}

/// A batch file being written: created empty, then one block appended per step.
pub struct BatchDump {
    path: PathBuf,
    file: File,
    rows: usize,
    seq: usize,
}

impl BatchDump {
    /// Creates (or empties) `path` for `[rows, seq + 1]` blocks.
    pub fn create(path: &Path, rows: usize, seq: usize) -> Result<Self, String> {
        let file = File::create(path)
            .map_err(|e| format!("--dump-batches: cannot create `{}`: {e}", path.display()))?;
        Ok(BatchDump {
            path: path.to_path_buf(),
            file,
            rows,
            seq,
        })
    }

    /// Appends step `step`'s batch as one block.
    pub fn append(&mut self, step: u64, b: &Batch) -> Result<(), String> {
        let ids = batch_rows(b, self.rows, self.seq)
            .map_err(|e| format!("--dump-batches: step {step}: {e}"))?;
        let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.file
            .write_all(&bytes)
            .and_then(|()| self.file.flush())
            .map_err(|e| {
                format!(
                    "--dump-batches: cannot write `{}`: {e}",
                    self.path.display()
                )
            })
    }
}

/// Writes `params` (name, value) to `path` as F32 safetensors, atomically.
pub fn write_init(path: &Path, params: &[(String, HostTensor)]) -> Result<(), String> {
    let mut tensors = Vec::with_capacity(params.len());
    for (name, t) in params {
        if t.ty.dtype != DType::F32 {
            return Err(format!(
                "--init-out: parameter `{name}` is {}; the file holds F32 parameters only",
                t.ty
            ));
        }
        tensors.push((
            name.clone(),
            Dtype::F32,
            t.ty.shape.clone(),
            tensor_bytes(t),
        ));
    }
    let metadata = HashMap::from([("format".to_string(), "graphtrain-init".to_string())]);
    let bytes = to_safetensors(&tensors, metadata)
        .map_err(|e| format!("--init-out `{}`: {e}", path.display()))?;
    write_atomically(path, &bytes).map_err(|e| format!("--init-out: {e}"))
}
