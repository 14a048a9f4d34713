//! `run --init PATH`: a run's starting parameters read from a file instead of drawn from its
//! seed, to go on from weights trained elsewhere (fine-tuning on other data, or the same
//! weights as another framework's run).
//!
//! What it reads:
//! - a safetensors file of parameters under the graph's names (torchtitan's, e.g.
//!   `layers.0.attention.wq.weight`, Linear weights `[out, in]`): what `run --init-out` writes,
//!   or another framework's weights saved under those names. F32, BF16 and F16 tensors are
//!   read, the last two widened to f32 exactly; any other dtype is refused rather than rounded.
//! - a Hugging Face Llama model folder (or one of its files): transformers' names mapped to the
//!   graph's (`hf.rs`), with the config read from its `config.json` (`--config DIR`).
//! - a graphtrain checkpoint (a file, or a sharded checkpoint's folder), verified as `--resume`
//!   verifies it: its parameters only. Its optimizer state (`opt.*`) and step count are left
//!   behind: the run starts at step 1 with fresh optimizer state, from those weights. The
//!   tokenizer it carries (a run on text) is the one its embeddings know: `run` tokenizes new
//!   text with it unless `--tokenizer` says otherwise.
//!
//! Guarantees: every parameter comes from the file, bit for bit (or widened exactly); a
//! parameter the file lacks, a tensor of another shape, a tensor that is no parameter of the
//! step, and a non-finite value are errors that name the tensor. Nothing is written.

use crate::{checkpoint, sharded};
use graphtrain_ir::{DType, HostTensor, TensorType};
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::Path;

/// Named whole tensors from an `--init` file, and whether they came from a checkpoint (whose
/// optimizer state is then expected among them and left unused).
pub struct InitialWeights {
    pub tensors: Vec<(String, HostTensor)>,
    pub from_checkpoint: bool,
    /// The tokenizer a checkpoint of a run on text carries (its `tokenizer.json`): the one
    /// its embeddings were trained with.
    pub tokenizer_json: Option<String>,
}

/// Whether a tensor of this name that is no parameter may be left unused: a checkpoint's
/// optimizer state.
pub fn unused_is_fine(from_checkpoint: bool, name: &str) -> bool {
    from_checkpoint && name.starts_with("opt.")
}

/// Reads `path` (see the module's doc); the error names the file and what is wrong with it.
pub fn read(path: &Path) -> Result<InitialWeights, String> {
    let at = |what: String| format!("`{}`: {what}", path.display());
    if path.is_dir() && path.join(sharded::MANIFEST).exists() {
        return checkpoint_weights(sharded::load_any(path)?);
    }
    if path.is_dir() {
        // A model folder: every safetensors file in it (transformers' shards).
        let mut files: Vec<_> = std::fs::read_dir(path)
            .map_err(|e| at(format!("cannot read the folder: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(at(
                "a folder with no *.safetensors file and no checkpoint manifest".into(),
            ));
        }
        let mut tensors = Vec::new();
        for file in &files {
            tensors.extend(plain_file(file)?);
        }
        return named_as_the_graph(tensors).map_err(at);
    }
    let bytes = std::fs::read(path).map_err(|e| at(format!("cannot read it: {e}")))?;
    let (_, info) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| at(format!("not a safetensors file ({e})")))?;
    let is_checkpoint = info
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format"))
        .is_some_and(|f| f == checkpoint::FORMAT);
    if is_checkpoint {
        return checkpoint_weights(checkpoint::from_bytes(&bytes).map_err(at)?);
    }
    named_as_the_graph(tensors_of(&bytes).map_err(at)?).map_err(at)
}

/// The tensors of one plain safetensors file (no checkpoint), widened to f32.
fn plain_file(path: &Path) -> Result<Vec<(String, HostTensor)>, String> {
    let at = |what: String| format!("`{}`: {what}", path.display());
    let bytes = std::fs::read(path).map_err(|e| at(format!("cannot read it: {e}")))?;
    tensors_of(&bytes).map_err(at)
}

fn tensors_of(bytes: &[u8]) -> Result<Vec<(String, HostTensor)>, String> {
    let file =
        SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file ({e})"))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let data = widened(view.dtype(), view.data())
            .map_err(|what| format!("tensor `{name}` is {what}"))?;
        let t = finite(
            &name,
            TensorType::new(DType::F32, view.shape().to_vec()),
            data,
        )?;
        tensors.push((name, t));
    }
    Ok(tensors)
}

/// `tensors` under the graph's names: transformers' Llama names mapped (`hf::graph_name`,
/// its buffers dropped), the graph's own kept; sorted by name.
fn named_as_the_graph(tensors: Vec<(String, HostTensor)>) -> Result<InitialWeights, String> {
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    let mut tensors = if crate::hf::is_hf(&names) {
        let mut mapped = Vec::new();
        for (name, t) in tensors {
            if let Some(ours) = crate::hf::graph_name(&name)? {
                mapped.push((ours, t));
            }
        }
        mapped
    } else {
        tensors
    };
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = tensors.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!("tensor `{}` is given twice", w[0].0));
    }
    Ok(InitialWeights {
        tensors,
        from_checkpoint: false,
        tokenizer_json: None,
    })
}

/// A checkpoint's tensors, all of them (the trainer takes the parameters).
fn checkpoint_weights(ckpt: checkpoint::Checkpoint) -> Result<InitialWeights, String> {
    let tokenizer_json = ckpt.header.extra.get(crate::cli::TOKENIZER_KEY).cloned();
    Ok(InitialWeights {
        tensors: ckpt.named_tensors(),
        from_checkpoint: true,
        tokenizer_json,
    })
}

/// Little-endian `bytes` of `dtype` as the f32 values they hold, exactly.
fn widened(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f64>, String> {
    match dtype {
        Dtype::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect()),
        Dtype::BF16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
            .collect()),
        Dtype::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64)
            .collect()),
        other => Err(format!(
            "{other:?}; parameters are read from F32, BF16 or F16 (widened exactly), and \
{other:?} would have to be rounded: convert it first"
        )),
    }
}

/// The f32 of IEEE half-precision bits (every half is an f32 exactly).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        // Subnormal: frac · 2^-24.
        (0, _) => return sign_of(h) * frac as f32 * 2f32.powi(-24),
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (frac << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

fn sign_of(h: u16) -> f32 {
    if h & 0x8000 != 0 {
        -1.0
    } else {
        1.0
    }
}

/// `data` as a tensor of `ty`, refused where a value is NaN or infinite (it would make every
/// loss NaN from the first step) or where the count does not match the shape.
fn finite(name: &str, ty: TensorType, data: Vec<f64>) -> Result<HostTensor, String> {
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "tensor `{name}` holds {} at element {i}: initial parameters must be finite",
            data[i]
        ));
    }
    HostTensor::new(ty, data).map_err(|e| format!("tensor `{name}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_widen_exactly() {
        for (h, want) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0001, 2f32.powi(-24)),
            (0x8001, -(2f32.powi(-24))),
            (0x03ff, 1023.0 * 2f32.powi(-24)),
            (0x0400, 2f32.powi(-14)),
            (0x3555, 0.333_251_95),
        ] {
            assert_eq!(f16_to_f32(h).to_bits(), want.to_bits(), "{h:#06x}");
        }
        assert!(f16_to_f32(0x7c00).is_infinite() && f16_to_f32(0x7e00).is_nan());
        let bf16 = widened(Dtype::BF16, &[0x80, 0x3f, 0x49, 0xc0]).unwrap();
        assert_eq!(bf16, vec![1.0, -3.140625]);
        let e = widened(Dtype::F64, &[0; 8]).unwrap_err();
        assert!(e.contains("F64") && e.contains("rounded"), "{e}");
    }

    #[test]
    fn a_non_finite_value_is_refused_by_name() {
        let ty = TensorType::new(DType::F32, vec![2]);
        let e = finite("w", ty, vec![1.0, f64::NAN]).unwrap_err();
        assert!(e.contains("`w`") && e.contains("element 1"), "{e}");
    }
}
