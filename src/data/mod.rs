//! Training data: what the trainer feeds as tokens and targets. Either synthetic (`random`,
//! `fixed`: seeded random ids, no files) or real text (a corpus tokenized by a BPE, cut into rows,
//! shuffled per epoch). Every source gives batch `k` as a pure function of (seed, k), so a resumed
//! run continues on exactly the data it would have seen.

pub mod corpus;
pub mod fingerprint;
pub mod prepare;
pub mod random;
pub mod text;
pub mod tokenizer;
pub mod tokens;

pub use random::{batch, DataMode};
pub use text::TextData;

use std::path::Path;
use std::sync::Arc;

/// Inputs and next-token targets, each `[batch, seq]` row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<i64>,
    pub targets: Vec<i64>,
}

/// Where the trainer's batches come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// A fresh random batch every step.
    Random,
    /// Batch 0 at every step.
    Fixed,
    /// Rows of a tokenized text.
    Text(Arc<TextData>),
}

impl From<DataMode> for DataSource {
    fn from(mode: DataMode) -> Self {
        match mode {
            DataMode::Random => DataSource::Random,
            DataMode::Fixed => DataSource::Fixed,
        }
    }
}

impl DataSource {
    /// Training batch `k` (0-based) of `batch` rows of `seq` tokens below `vocab`.
    pub fn batch(
        &self,
        seed: u64,
        k: u64,
        batch: usize,
        seq: usize,
        vocab: usize,
    ) -> Result<Batch, String> {
        self.rows(seed, k, batch, 0..batch, seq, vocab)
    }

    /// Rows `rows` of training batch `k`: what `batch` gives for them, reading or making only
    /// them (a data-parallel rank's share of the batch).
    pub fn rows(
        &self,
        seed: u64,
        k: u64,
        batch: usize,
        rows: std::ops::Range<usize>,
        seq: usize,
        vocab: usize,
    ) -> Result<Batch, String> {
        if rows.end > batch || rows.start > rows.end {
            return Err(format!("rows {rows:?} of a batch of {batch}"));
        }
        match self {
            DataSource::Random => Ok(random::rows(
                DataMode::Random,
                seed,
                k,
                batch,
                rows,
                seq,
                vocab,
            )),
            DataSource::Fixed => Ok(random::rows(
                DataMode::Fixed,
                seed,
                k,
                batch,
                rows,
                seq,
                vocab,
            )),
            DataSource::Text(t) => {
                if t.vocab_size() > vocab {
                    return Err(format!(
                        "the tokens use a vocab of {}, larger than the model's vocab_size {vocab}",
                        t.vocab_size()
                    ));
                }
                t.train_rows_of(seed, k, batch, rows, seq)
            }
        }
    }

    /// The string a checkpoint records to refuse resuming on other data: `random`, `fixed`, or
    /// `text:<source fp>:<tokenizer fp>:<val fraction>`.
    pub fn identity(&self) -> String {
        match self {
            DataSource::Random => "random".to_string(),
            DataSource::Fixed => "fixed".to_string(),
            DataSource::Text(t) => t.identity(),
        }
    }

    pub fn text(&self) -> Option<&TextData> {
        match self {
            DataSource::Text(t) => Some(t),
            _ => None,
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, creating
/// the folder if needed: readers see the old file or the whole new one, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create folder `{}`: {e}", dir.display()))?;
    let name = path
        .file_name()
        .ok_or_else(|| format!("`{}` is not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write `{}`: {e}", path.display())
    })
}
