//! Checkpoints: everything a run needs to continue exactly where it stopped (parameters,
//! optimizer state, the step count and the run's configuration), written atomically.
//!
//! Format (version 1): the line `graphtrain-checkpoint 1\n`, the byte length of the header as a
//! little-endian u64, the header in RON (`Header`), then the tensors back to back in header order,
//! little-endian, f32 tensors as f32 and every other dtype as f64. Values held by the trainer are
//! already rounded to their dtype, so the round trip is exact and a resumed run is bitwise
//! identical to an uninterrupted one (`tests/checkpoint.rs`).

use crate::data::DataSource;
use graphtrain_ir::interp::HostTensor;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::{DType, TensorType};
use graphtrain_models::Llama3Config;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

const MAGIC: &[u8] = b"graphtrain-checkpoint 1\n";

/// What a run was, so that a resume can refuse a checkpoint from a different one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    pub model: Llama3Config,
    pub seed: u64,
    pub data: String,
    pub optim: OptimConfig,
}

impl RunIdentity {
    /// `data` is a `DataSource` or a `DataMode`; its identity string is recorded.
    pub fn new(
        model: &Llama3Config,
        seed: u64,
        data: impl Into<DataSource>,
        optim: &OptimConfig,
    ) -> Self {
        RunIdentity {
            model: model.clone(),
            seed,
            data: data.into().identity(),
            optim: *optim,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub ty: TensorType,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub run: RunIdentity,
    /// Steps completed: the next step to run is `steps_done + 1`.
    pub steps_done: u64,
    pub tensors: Vec<TensorEntry>,
}

/// A checkpoint in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub header: Header,
    pub tensors: Vec<HostTensor>,
}

fn width(dtype: DType) -> usize {
    if dtype == DType::F32 {
        4
    } else {
        8
    }
}

/// Writes `ckpt` to `path` through a temporary file and a rename, so a crash mid-write leaves the
/// previous checkpoint intact.
pub fn save(path: &Path, ckpt: &Checkpoint) -> Result<(), String> {
    let header = ron::to_string(&ckpt.header)
        .map_err(|e| format!("cannot encode the checkpoint header: {e}"))?;
    let mut bytes = Vec::with_capacity(
        MAGIC.len()
            + 8
            + header.len()
            + ckpt
                .tensors
                .iter()
                .map(|t| t.data.len() * width(t.ty.dtype))
                .sum::<usize>(),
    );
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for t in &ckpt.tensors {
        for &v in &t.data {
            if t.ty.dtype == DType::F32 {
                bytes.extend_from_slice(&(v as f32).to_le_bytes());
            } else {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| format!("cannot write checkpoint `{}`: {e}", path.display()))
}

/// Reads a checkpoint, refusing truncated or foreign files with a message that says what is wrong.
pub fn load(path: &Path) -> Result<Checkpoint, String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read checkpoint `{}`: {e}", path.display()))?;
    let bad = |what: &str| {
        format!(
            "`{}` is not a usable graphtrain checkpoint: {what}",
            path.display()
        )
    };
    let rest = bytes
        .strip_prefix(MAGIC)
        .ok_or_else(|| bad("it does not start with `graphtrain-checkpoint 1`"))?;
    let (len, rest) = rest
        .split_at_checked(8)
        .ok_or_else(|| bad("it ends inside the header length"))?;
    let len = u64::from_le_bytes(len.try_into().expect("split at 8 bytes")) as usize;
    let (header, mut payload) = rest
        .split_at_checked(len)
        .ok_or_else(|| bad("it ends inside the header"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("the header is not UTF-8"))?;
    let header: Header =
        ron::from_str(header).map_err(|e| bad(&format!("the header does not parse: {e}")))?;
    let mut tensors = Vec::with_capacity(header.tensors.len());
    for entry in &header.tensors {
        let w = width(entry.ty.dtype);
        let n = entry.ty.numel();
        let (chunk, rest) = payload
            .split_at_checked(n * w)
            .ok_or_else(|| bad(&format!("it ends inside tensor `{}`", entry.name)))?;
        let data = chunk
            .chunks_exact(w)
            .map(|c| {
                if w == 4 {
                    f32::from_le_bytes(c.try_into().expect("4-byte chunk")) as f64
                } else {
                    f64::from_le_bytes(c.try_into().expect("8-byte chunk"))
                }
            })
            .collect();
        tensors.push(
            HostTensor::new(entry.ty.clone(), data)
                .map_err(|e| bad(&format!("tensor `{}`: {e}", entry.name)))?,
        );
        payload = rest;
    }
    if !payload.is_empty() {
        return Err(bad(&format!(
            "{} unexpected bytes after the last tensor",
            payload.len()
        )));
    }
    Ok(Checkpoint { header, tensors })
}
