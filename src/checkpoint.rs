//! Checkpoints: everything a run needs to continue exactly where it stopped (parameters,
//! optimizer state, the step count, the data position and the run's configuration), written
//! atomically as safetensors and verified byte for byte when read back.
//!
//! Format (version 2): a safetensors file. Each parameter and optimizer-state tensor is a named
//! tensor, F32 tensors as F32 and every other dtype as F64: values held by the trainer are
//! already rounded to their dtype, so the round trip is exact and a resumed run is bitwise
//! identical to an uninterrupted one (`tests/checkpoint.rs`). `__metadata__` holds the format
//! tag and version, the run identity and the tensor list (name and graph type) as RON,
//! `steps_done`, `data_batches_consumed`, the graph fingerprint, an FNV-1a 64 checksum of every
//! tensor's bytes (`checksum.NAME`), the caller's open map (`extra.KEY`, verbatim), and a
//! checksum over all of that metadata (`metadata_checksum`).
//!
//! Guarantees: `save` writes a temporary file, syncs it, renames it over the target and syncs
//! the directory, so a crash leaves the previous checkpoint whole. `load` never writes, and
//! refuses with the path and the reason: a file that is not safetensors, truncated or extended
//! files, a safetensors file without graphtrain metadata, the older format 1 (named as such),
//! changed metadata, and any tensor whose bytes no longer match their checksum (named). Other
//! safetensors readers (Python's `safetensors`, numpy) read the tensors as they are; they ignore
//! the metadata.

use crate::data::DataSource;
use graphtrain_ir::interp::HostTensor;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::{DType, TensorType};
use graphtrain_models::Llama3Config;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

/// `__metadata__["format"]` of every graphtrain checkpoint.
pub const FORMAT: &str = "graphtrain-checkpoint";
/// `__metadata__["format_version"]` this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// Format 1 files start with this line.
const FORMAT_1_MAGIC: &[u8] = b"graphtrain-checkpoint 1\n";
/// Prefix of the per-tensor checksum keys in `__metadata__`.
const CHECKSUM_PREFIX: &str = "checksum.";
/// Prefix of the caller's open metadata keys in `__metadata__`.
const EXTRA_PREFIX: &str = "extra.";
const METADATA_CHECKSUM: &str = "metadata_checksum";

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
    /// Batches the data source has handed out; batch k is a pure function of (seed, k) today,
    /// so this equals `steps_done`, but a streaming source resumes from it.
    pub data_batches_consumed: u64,
    /// The step graph's fingerprint (`graphtrain_runtime::Fingerprint`, as displayed). It
    /// changes with the pass pipeline; state is restored by name, so it is informative only.
    pub fingerprint: String,
    pub tensors: Vec<TensorEntry>,
    /// Open metadata, written and read back verbatim (e.g. a tokenizer's JSON), covered by the
    /// metadata checksum.
    pub extra: BTreeMap<String, String>,
}

/// A checkpoint in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub header: Header,
    pub tensors: Vec<HostTensor>,
}

impl Checkpoint {
    /// Its tensors, each with its name, in the file's order.
    pub fn named_tensors(self) -> Vec<(String, HostTensor)> {
        let names = self.header.tensors.into_iter().map(|e| e.name);
        names.zip(self.tensors).collect()
    }
}

/// The checksum of tensors and metadata: 64-bit FNV-1a, the same fingerprint token files use;
/// any single changed byte changes it.
pub use crate::data::fingerprint::fnv1a64;

fn checksum_text(bytes: &[u8]) -> String {
    format!("fnv1a64:{:016x}", fnv1a64(bytes))
}

/// Checksum of every metadata entry but the checksum itself, length-prefixed so that moving
/// bytes between a key and its value changes it too.
fn metadata_checksum(metadata: &HashMap<String, String>) -> String {
    let sorted: BTreeMap<&String, &String> = metadata
        .iter()
        .filter(|(k, _)| k.as_str() != METADATA_CHECKSUM)
        .collect();
    let mut bytes = Vec::new();
    for (k, v) in sorted {
        for part in [k.as_bytes(), v.as_bytes()] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part);
        }
    }
    checksum_text(&bytes)
}

/// The safetensors dtype a graph dtype is stored as.
fn storage(dtype: DType) -> Dtype {
    if dtype == DType::F32 {
        Dtype::F32
    } else {
        Dtype::F64
    }
}

/// Little-endian bytes of `t` at its storage dtype.
pub(crate) fn tensor_bytes(t: &HostTensor) -> Vec<u8> {
    if storage(t.ty.dtype) == Dtype::F32 {
        t.data
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect()
    } else {
        t.data.iter().flat_map(|&v| v.to_le_bytes()).collect()
    }
}

/// Serializes named tensors (already in their storage bytes) with `metadata` as safetensors.
pub(crate) fn to_safetensors(
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| format!("tensor `{name}`: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, Some(metadata)).map_err(|e| format!("safetensors: {e}"))
}

/// Writes `bytes` to `path` through a temporary file beside it: written, synced, renamed over
/// `path`, and the directory synced, so `path` is always either the old file or the new one.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let write = || -> std::io::Result<()> {
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable only once the directory is synced.
        std::fs::File::open(dir.unwrap_or(Path::new(".")))?.sync_all()
    };
    write().map_err(|e| format!("cannot write `{}`: {e}", path.display()))
}

/// The checkpoint as a safetensors file's bytes.
pub fn to_bytes(ckpt: &Checkpoint) -> Result<Vec<u8>, String> {
    let h = &ckpt.header;
    if h.tensors.len() != ckpt.tensors.len() {
        return Err(format!(
            "the checkpoint lists {} tensors and holds {}",
            h.tensors.len(),
            ckpt.tensors.len()
        ));
    }
    let ron = |what: &str, r: Result<String, ron::Error>| {
        r.map_err(|e| format!("cannot encode the checkpoint's {what}: {e}"))
    };
    let mut metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        (
            "run".to_string(),
            ron("run identity", ron::to_string(&h.run))?,
        ),
        ("steps_done".to_string(), h.steps_done.to_string()),
        (
            "data_batches_consumed".to_string(),
            h.data_batches_consumed.to_string(),
        ),
        ("graph_fingerprint".to_string(), h.fingerprint.clone()),
        (
            "tensors".to_string(),
            ron("tensor list", ron::to_string(&h.tensors))?,
        ),
    ]);
    for (k, v) in &h.extra {
        metadata.insert(format!("{EXTRA_PREFIX}{k}"), v.clone());
    }
    let mut tensors = Vec::with_capacity(h.tensors.len());
    for (entry, t) in h.tensors.iter().zip(&ckpt.tensors) {
        if entry.ty != t.ty {
            return Err(format!(
                "tensor `{}` is listed as {} and holds {}",
                entry.name, entry.ty, t.ty
            ));
        }
        let bytes = tensor_bytes(t);
        let key = format!("{CHECKSUM_PREFIX}{}", entry.name);
        if metadata.insert(key, checksum_text(&bytes)).is_some() {
            return Err(format!("tensor `{}` is listed twice", entry.name));
        }
        tensors.push((
            entry.name.clone(),
            storage(t.ty.dtype),
            t.ty.shape.clone(),
            bytes,
        ));
    }
    let sum = metadata_checksum(&metadata);
    metadata.insert(METADATA_CHECKSUM.to_string(), sum);
    to_safetensors(&tensors, metadata)
}

/// Writes `ckpt` to `path` atomically (see `write_atomically`): a crash mid-write leaves the
/// previous checkpoint intact.
pub fn save(path: &Path, ckpt: &Checkpoint) -> Result<(), String> {
    let bytes =
        to_bytes(ckpt).map_err(|e| format!("cannot write checkpoint `{}`: {e}", path.display()))?;
    write_atomically(path, &bytes).map_err(|e| format!("checkpoint: {e}"))
}

/// Reads and verifies a checkpoint, refusing anything it cannot vouch for with a message that
/// names the path and what is wrong.
pub fn load(path: &Path) -> Result<Checkpoint, String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read checkpoint `{}`: {e}", path.display()))?;
    from_bytes(&bytes).map_err(|what| {
        format!(
            "`{}` is not a usable graphtrain checkpoint: {what}",
            path.display()
        )
    })
}

/// Parses and verifies a checkpoint from a safetensors file's bytes (`load` adds the path).
pub fn from_bytes(bytes: &[u8]) -> Result<Checkpoint, String> {
    if bytes.starts_with(FORMAT_1_MAGIC) {
        return Err(format!(
            "it is a format 1 graphtrain checkpoint (the raw layout written before checkpoints \
became safetensors); this build reads format {FORMAT_VERSION} only, so start that run again"
        ));
    }
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(format!(
            "it is {} bytes long, too short for a safetensors file",
            bytes.len()
        ));
    };
    if rest.first() != Some(&b'{') {
        return Err(
            "it is not a safetensors file (no JSON header after the 8-byte length)".to_string(),
        );
    }
    let header_len = u64::from_le_bytes(*len);
    if header_len > rest.len() as u64 {
        return Err(format!(
            "it is truncated: its header says {header_len} bytes and only {} follow",
            rest.len()
        ));
    }
    let (header_len, info) = SafeTensors::read_metadata(bytes).map_err(|e| match e {
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "its tensor data does not end where the header says (truncated, or bytes \
appended): the file is {} bytes",
            bytes.len()
        ),
        e => format!("it is not a valid safetensors file: {e}"),
    })?;
    let data = &bytes[8 + header_len..];
    let metadata = info.metadata().as_ref().ok_or_else(|| {
        "it is a safetensors file without `__metadata__`, so not a graphtrain checkpoint"
            .to_string()
    })?;
    let field = |key: &str| {
        metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| format!("its metadata has no `{key}`"))
    };
    match metadata.get("format").map(String::as_str) {
        Some(FORMAT) => {}
        Some(other) => {
            return Err(format!(
                "its metadata says format `{other}`, not `{FORMAT}`"
            ))
        }
        None => {
            return Err(
                "its metadata has no `format`: a safetensors file, but not a graphtrain checkpoint"
                    .to_string(),
            )
        }
    }
    let version = field("format_version")?;
    if version != FORMAT_VERSION.to_string() {
        let age = match version.parse::<u32>() {
            Ok(v) if v < FORMAT_VERSION => "an older",
            Ok(_) => "a newer",
            Err(_) => "an unknown",
        };
        return Err(format!(
            "it is {age} graphtrain checkpoint format ({version}); this build reads format \
{FORMAT_VERSION}"
        ));
    }
    let want = field(METADATA_CHECKSUM)?;
    let got = metadata_checksum(metadata);
    if want != got {
        return Err(format!(
            "its metadata changed after it was written (metadata checksum {want}, the \
metadata now sums to {got})"
        ));
    }
    let parse_u64 = |key: &str| -> Result<u64, String> {
        let v = field(key)?;
        v.parse()
            .map_err(|_| format!("its `{key}` is `{v}`, not a count"))
    };
    let run: RunIdentity = ron::from_str(field("run")?)
        .map_err(|e| format!("its run identity does not parse: {e}"))?;
    let entries: Vec<TensorEntry> = ron::from_str(field("tensors")?)
        .map_err(|e| format!("its tensor list does not parse: {e}"))?;
    let extra: BTreeMap<String, String> = metadata
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(EXTRA_PREFIX)?.to_string(), v.clone())))
        .collect();
    let held = info.tensors();
    if held.len() != entries.len() {
        let listed: std::collections::HashSet<&str> =
            entries.iter().map(|e| e.name.as_str()).collect();
        let unlisted = held
            .keys()
            .find(|n| !listed.contains(n.as_str()))
            .map_or("?", String::as_str);
        return Err(format!(
            "it holds {} tensors and its metadata lists {} (`{unlisted}` is not listed)",
            held.len(),
            entries.len()
        ));
    }
    let mut tensors = Vec::with_capacity(entries.len());
    for entry in &entries {
        let name = &entry.name;
        let stored = held
            .get(name)
            .ok_or_else(|| format!("its metadata lists tensor `{name}`, which it does not hold"))?;
        let dtype = storage(entry.ty.dtype);
        if stored.dtype != dtype || stored.shape != entry.ty.shape {
            return Err(format!(
                "tensor `{name}` is stored as {:?} {:?}; its metadata says {} (stored as {dtype:?})",
                stored.dtype, stored.shape, entry.ty
            ));
        }
        // `read_metadata` checked that the offsets tile the data exactly.
        let raw = &data[stored.data_offsets.0..stored.data_offsets.1];
        let want = field(&format!("{CHECKSUM_PREFIX}{name}"))?;
        let got = checksum_text(raw);
        if want != got {
            return Err(format!(
                "tensor `{name}`: its bytes changed after it was written (checksum {want}, \
the data now sums to {got})"
            ));
        }
        let data = if dtype == Dtype::F32 {
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4-byte chunk")) as f64)
                .collect()
        } else {
            raw.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect()
        };
        tensors.push(
            HostTensor::new(entry.ty.clone(), data).map_err(|e| format!("tensor `{name}`: {e}"))?,
        );
    }
    Ok(Checkpoint {
        header: Header {
            run,
            steps_done: parse_u64("steps_done")?,
            data_batches_consumed: parse_u64("data_batches_consumed")?,
            fingerprint: field("graph_fingerprint")?.to_string(),
            tensors: entries,
            extra,
        },
        tensors,
    })
}
