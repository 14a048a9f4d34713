//! Hugging Face Llama checkpoints: a model folder as transformers writes it (`config.json`,
//! `model.safetensors` or its shards) read as a graphtrain config (`--config DIR/config.json`)
//! and starting parameters (`--init DIR`), and a checkpoint written as one (`graphtrain
//! export`), for transformers and the tools around it.
//!
//! The mapping: transformers' `LlamaForCausalLM` names become torchtitan's
//! (`model.layers.N.self_attn.q_proj.weight` -> `layers.N.attention.wq.weight`, ...), Linear
//! weights keep their `[out, in]` layout, and the config takes `rope_layout: Half`: transformers
//! stores q and k permuted for its `rotate_half` RoPE, which is graphtrain's `Half` layout, so
//! the weights need no permutation. A config graphtrain cannot train as written is refused by
//! field (RoPE scaling, biases, another activation, another `head_dim`), never approximated.
//!
//! Export writes the inverse: the config (the sequence length as `max_position_embeddings`),
//! the parameters under transformers' names, and a config of `rope_layout: Interleaved` (Meta's
//! pairs `(2i, 2i + 1)`) with each head's q and k rows reordered to `rotate_half`'s pairs
//! `(i, i + d/2)`, as transformers' own conversion of Meta's weights does: the attention
//! scores are the same sums in another order.
//!
//! A config.json holds no batch and no sequence length: the batch is 8 (`--batch` sets it) and
//! the sequence `max_position_embeddings`, at most 2048 (`graphtrain config show DIR/config.json`
//! prints the result, to edit as RON).

use graphtrain_ir::RopeLayout;
use graphtrain_models::Llama3Config;
use serde_json::Value;

/// The longest sequence a config read from config.json trains on by default.
const MAX_DEFAULT_SEQ: usize = 2048;
/// The batch of a config read from config.json.
const DEFAULT_BATCH: usize = 8;

/// A transformers Llama `config.json` as a graphtrain config; the error names the field.
pub fn config_from_hf(text: &str) -> Result<Llama3Config, String> {
    let json: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let field = |name: &str| json.get(name).filter(|v| !v.is_null());
    let count = |name: &str| -> Result<usize, String> {
        let v = field(name).ok_or_else(|| format!("no `{name}`"))?;
        v.as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| format!("`{name}` is {v}, not a positive whole number"))
    };
    let number = |name: &str, default: f64| -> Result<f64, String> {
        match field(name) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("`{name}` is {v}, not a positive number")),
        }
    };
    match field("model_type").and_then(Value::as_str) {
        Some("llama") => {}
        Some(other) => {
            return Err(format!(
                "`model_type` is `{other}`; graphtrain reads Llama (`llama`) checkpoints"
            ))
        }
        None => return Err("no `model_type` (a transformers config names its model)".into()),
    }
    if let Some(scaling) = field("rope_scaling") {
        return Err(format!(
            "`rope_scaling` is {scaling}: RoPE scaling (Llama 3.1's and others') is not built; \
a config without it trains"
        ));
    }
    for flag in ["attention_bias", "mlp_bias"] {
        if field(flag).and_then(Value::as_bool) == Some(true) {
            return Err(format!(
                "`{flag}` is true: graphtrain's Linear layers have no bias"
            ));
        }
    }
    if let Some(act) = field("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(format!(
                "`hidden_act` is `{act}`: graphtrain's feed-forward is SwiGLU (`silu`)"
            ));
        }
    }
    let dim = count("hidden_size")?;
    let n_heads = count("num_attention_heads")?;
    let n_kv_heads = match field("num_key_value_heads") {
        Some(_) => count("num_key_value_heads")?,
        None => n_heads,
    };
    if let Some(head_dim) = field("head_dim") {
        if head_dim.as_u64() != Some((dim / n_heads) as u64) {
            return Err(format!(
                "`head_dim` is {head_dim}; graphtrain's heads are hidden_size / \
num_attention_heads = {}",
                dim / n_heads
            ));
        }
    }
    let seq_len = match field("max_position_embeddings") {
        Some(_) => count("max_position_embeddings")?.min(MAX_DEFAULT_SEQ),
        None => MAX_DEFAULT_SEQ,
    };
    let cfg = Llama3Config {
        dim,
        n_layers: count("num_hidden_layers")?,
        n_heads,
        n_kv_heads,
        vocab_size: count("vocab_size")?,
        ffn_hidden: count("intermediate_size")?,
        rope_theta: number("rope_theta", 10000.0)?,
        rope_layout: RopeLayout::Half,
        norm_eps: number("rms_norm_eps", 1e-6)?,
        batch: DEFAULT_BATCH,
        seq_len,
        tied_embeddings: field("tie_word_embeddings").and_then(Value::as_bool) == Some(true),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Tensors outside the layers: (the graph's name, transformers').
const TOP_NAMES: [[&str; 2]; 3] = [
    ["tok_embeddings.weight", "model.embed_tokens.weight"],
    ["norm.weight", "model.norm.weight"],
    ["output.weight", "lm_head.weight"],
];

/// A layer's tensors, after `layers.N.` and `model.layers.N.`: (the graph's, transformers').
const LAYER_NAMES: [[&str; 2]; 9] = [
    ["attention.wq.weight", "self_attn.q_proj.weight"],
    ["attention.wk.weight", "self_attn.k_proj.weight"],
    ["attention.wv.weight", "self_attn.v_proj.weight"],
    ["attention.wo.weight", "self_attn.o_proj.weight"],
    ["feed_forward.w1.weight", "mlp.gate_proj.weight"],
    ["feed_forward.w3.weight", "mlp.up_proj.weight"],
    ["feed_forward.w2.weight", "mlp.down_proj.weight"],
    ["attention_norm.weight", "input_layernorm.weight"],
    ["ffn_norm.weight", "post_attention_layernorm.weight"],
];

/// `name` through the tables, from the side `from` (0: the graph's, 1: transformers') to the
/// other, whose layers are under `to_layers`; `None` where it is no tensor of the tables.
fn translate(name: &str, from: usize, from_layers: &str, to_layers: &str) -> Option<String> {
    let to = 1 - from;
    if let Some(pair) = TOP_NAMES.iter().find(|p| p[from] == name) {
        return Some(pair[to].to_string());
    }
    let (layer, part) = name.strip_prefix(from_layers)?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let pair = LAYER_NAMES.iter().find(|p| p[from] == part)?;
    Some(format!("{to_layers}{layer}.{}", pair[to]))
}

/// The graph's name of a transformers Llama tensor; `Ok(None)` for buffers that are no
/// parameter (`rotary_emb.inv_freq`, which older transformers saved); an error for a name
/// that maps to nothing.
pub fn graph_name(hf: &str) -> Result<Option<String>, String> {
    if hf.ends_with("rotary_emb.inv_freq") {
        return Ok(None);
    }
    translate(hf, 1, "model.layers.", "layers.")
        .map(Some)
        .ok_or_else(|| format!("`{hf}` is no tensor of a transformers Llama"))
}

/// Whether these tensor names are transformers' (every Llama checkpoint of it has
/// `model.embed_tokens.weight`).
pub fn is_hf(names: &[&str]) -> bool {
    names.iter().any(|n| n.starts_with("model."))
}

/// A graphtrain config as a transformers `LlamaConfig` (`config.json`), weights in `dtype`
/// (`float32` or `bfloat16`).
pub fn config_to_hf(cfg: &Llama3Config, dtype: &str) -> Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.dim / cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "max_position_embeddings": cfg.seq_len,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": dtype,
    })
}

/// transformers' name of a graph parameter (the inverse of `graph_name`).
pub fn hf_name(ours: &str) -> Result<String, String> {
    translate(ours, 0, "layers.", "model.layers.")
        .ok_or_else(|| format!("`{ours}` is no parameter of graphtrain's Llama"))
}

/// The rows of a q or k projection (`[heads * d, in]`, rows in Meta's interleaved pair order
/// per head) in `rotate_half`'s order: row `h·d + j·d/2 + i` takes row `h·d + 2i + j`.
pub fn interleaved_to_half(rows: &[f64], heads: usize, cols: usize) -> Vec<f64> {
    let d = rows.len() / cols / heads;
    let mut out = vec![0.0; rows.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let (to, from) = (h * d + j * d / 2 + i, h * d + 2 * i + j);
                out[to * cols..(to + 1) * cols]
                    .copy_from_slice(&rows[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// How `export` stores the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportDtype {
    /// Exactly the checkpoint's values.
    F32,
    /// Rounded to the nearest bf16 (ties to even): half the bytes, as most published weights.
    Bf16,
}

/// Writes the parameters of `ckpt` (a run's checkpoint; its optimizer state stays behind) into
/// the folder `dir` as transformers reads a Llama: `config.json`, `model.safetensors` and, for
/// a run on text, `tokenizer.json`. Returns what it wrote, in words.
pub fn export(
    ckpt: crate::checkpoint::Checkpoint,
    dir: &std::path::Path,
    dtype: ExportDtype,
) -> Result<String, String> {
    let cfg = ckpt.header.run.model.clone();
    let tokenizer = ckpt.header.extra.get(crate::cli::TOKENIZER_KEY).cloned();
    let (stored, torch_dtype) = match dtype {
        ExportDtype::F32 => (safetensors::Dtype::F32, "float32"),
        ExportDtype::Bf16 => (safetensors::Dtype::BF16, "bfloat16"),
    };
    let mut tensors = Vec::new();
    for (name, t) in ckpt.named_tensors() {
        if name.starts_with("opt.") {
            continue;
        }
        let theirs = hf_name(&name)?;
        let heads = match name.rsplit_once(".attention.") {
            Some((_, "wq.weight")) => Some(cfg.n_heads),
            Some((_, "wk.weight")) => Some(cfg.n_kv_heads),
            _ => None,
        };
        let data = match (heads, cfg.rope_layout) {
            (Some(heads), RopeLayout::Interleaved) => {
                interleaved_to_half(&t.data, heads, t.ty.shape[1])
            }
            _ => t.data,
        };
        let bytes: Vec<u8> = match dtype {
            ExportDtype::F32 => data
                .iter()
                .flat_map(|&v| (v as f32).to_le_bytes())
                .collect(),
            ExportDtype::Bf16 => data
                .iter()
                .flat_map(|&v| {
                    let rounded = graphtrain_ir::host_tensor::round_bf16(v as f32);
                    ((rounded.to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect(),
        };
        tensors.push((theirs, stored, t.ty.shape.clone(), bytes));
    }
    let count = tensors.len();
    // transformers loads a safetensors file only with a `format` it knows.
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = crate::checkpoint::to_safetensors(&tensors, metadata)?;
    let config = serde_json::to_string_pretty(&config_to_hf(&cfg, torch_dtype))
        .map_err(|e| format!("config.json: {e}"))?;
    let write = |file: &str, bytes: &[u8]| {
        crate::checkpoint::write_atomically(&dir.join(file), bytes)
            .map_err(|e| format!("{}: {e}", dir.join(file).display()))
    };
    write("config.json", config.as_bytes())?;
    write("model.safetensors", &weights)?;
    if let Some(json) = &tokenizer {
        write("tokenizer.json", json.as_bytes())?;
    }
    Ok(format!(
        "config.json, model.safetensors ({count} tensors, {torch_dtype}){}",
        if tokenizer.is_some() {
            ", tokenizer.json"
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
  "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_hidden_layers": 3, "vocab_size": 300, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": true,
  "rope_scaling": null, "attention_bias": false, "torch_dtype": "bfloat16"
}"#;

    #[test]
    fn a_llama_config_reads_field_by_field() {
        let cfg = config_from_hf(SMALL).unwrap();
        assert_eq!(
            (
                cfg.dim,
                cfg.n_layers,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.ffn_hidden
            ),
            (64, 3, 4, 2, 172)
        );
        assert_eq!((cfg.vocab_size, cfg.seq_len, cfg.batch), (300, 2048, 8));
        assert_eq!(cfg.rope_layout, RopeLayout::Half);
        assert!(cfg.tied_embeddings && cfg.norm_eps == 1e-5 && cfg.rope_theta == 10000.0);
    }

    #[test]
    fn what_graphtrain_cannot_train_is_refused_by_field() {
        for (change, needle) in [
            (r#""model_type": "llama""#, r#""model_type": "mistral""#),
            (
                r#""rope_scaling": null"#,
                r#""rope_scaling": {"rope_type": "llama3"}"#,
            ),
            (r#""attention_bias": false"#, r#""attention_bias": true"#),
            (r#""hidden_act": "silu""#, r#""hidden_act": "gelu""#),
            (r#""hidden_size": 64"#, r#""hidden_size": 0"#),
            (
                r#""rope_theta": 10000.0"#,
                r#""head_dim": 32, "rope_theta": 10000.0"#,
            ),
        ] {
            let text = SMALL.replace(change, needle);
            let field = needle.split('"').nth(1).unwrap();
            let e = config_from_hf(&text).unwrap_err();
            assert!(e.contains(field), "{needle}: {e}");
        }
    }

    #[test]
    fn exported_names_and_rows_invert_the_reading() {
        for ours in [
            "tok_embeddings.weight",
            "layers.3.feed_forward.w2.weight",
            "output.weight",
        ] {
            let theirs = hf_name(ours).unwrap();
            assert_eq!(graph_name(&theirs).unwrap().as_deref(), Some(ours));
        }
        assert!(hf_name("layers.0.attention.wq.bias").is_err());
        // Two heads of 4 rows, one column: pairs (0,1),(2,3) become (0,2),(1,3).
        let rows: Vec<f64> = (0..8).map(f64::from).collect();
        assert_eq!(
            interleaved_to_half(&rows, 2, 1),
            vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
        );
        let cfg = Llama3Config::builtin("tiny").unwrap();
        let back = config_from_hf(&config_to_hf(&cfg, "float32").to_string()).unwrap();
        assert_eq!(
            back,
            Llama3Config {
                rope_layout: RopeLayout::Half,
                batch: 8,
                ..cfg
            }
        );
    }

    #[test]
    fn names_map_to_torchtitans_and_strangers_are_refused() {
        for (hf, ours) in [
            ("model.embed_tokens.weight", "tok_embeddings.weight"),
            (
                "model.layers.11.self_attn.k_proj.weight",
                "layers.11.attention.wk.weight",
            ),
            (
                "model.layers.0.mlp.gate_proj.weight",
                "feed_forward.w1.weight",
            ),
            (
                "model.layers.2.mlp.up_proj.weight",
                "layers.2.feed_forward.w3.weight",
            ),
            (
                "model.layers.0.post_attention_layernorm.weight",
                "ffn_norm.weight",
            ),
            ("lm_head.weight", "output.weight"),
        ] {
            let got = graph_name(hf).unwrap().unwrap();
            assert!(got.ends_with(ours), "{hf} -> {got}");
        }
        assert_eq!(
            graph_name("model.layers.0.self_attn.rotary_emb.inv_freq"),
            Ok(None)
        );
        for bad in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.bias",
        ] {
            assert!(graph_name(bad).unwrap_err().contains(bad));
        }
    }
}
