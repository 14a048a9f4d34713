//! Llama 3 (torchtitan's layout and parameter names): token embedding, `n_layers` blocks of
//! RMSNorm → grouped-query attention with RoPE → residual, RMSNorm → SwiGLU → residual, then a
//! final RMSNorm, the output head and the mean cross-entropy loss.

use graphtrain_ir::{
    DType, Init, Phase, RopeLayout, Tensor, TensorType, Traced, Tracer, TypeError,
};
use serde::{Deserialize, Serialize};

/// Every field a Llama 3 run needs. RON files given to `--config` hold exactly these fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Config {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); equal to `n_heads` for plain multi-head.
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    /// Hidden size of the SwiGLU feed-forward.
    pub ffn_hidden: usize,
    pub rope_theta: f64,
    pub rope_layout: RopeLayout,
    pub norm_eps: f64,
    pub batch: usize,
    pub seq_len: usize,
    /// Share the embedding table with the output head.
    pub tied_embeddings: bool,
}

/// Built-in configurations, by name.
pub const LLAMA3_CONFIGS: &[&str] = &["tiny", "small", "debug", "peer", "8b", "70b", "405b"];

impl Llama3Config {
    /// A built-in configuration, or `None` for an unknown name.
    pub fn builtin(name: &str) -> Option<Self> {
        let base = Llama3Config {
            dim: 256,
            n_layers: 6,
            n_heads: 16,
            n_kv_heads: 16,
            vocab_size: 2048,
            ffn_hidden: 768,
            rope_theta: 500000.0,
            rope_layout: RopeLayout::Interleaved,
            norm_eps: 1e-5,
            batch: 8,
            seq_len: 2048,
            tied_embeddings: false,
        };
        Some(match name {
            // Small enough for tests on the reference interpreter; exercises GQA.
            "tiny" => Llama3Config {
                dim: 32,
                n_layers: 2,
                n_heads: 4,
                n_kv_heads: 2,
                vocab_size: 64,
                ffn_hidden: 48,
                batch: 2,
                seq_len: 16,
                ..base
            },
            // Trains on real text in minutes on two cores (the README's run): a 2,048-token BPE
            // vocabulary, and the PyTorch peer's layout (rotate-half RoPE with theta 10,000, no
            // GQA), so its runs can be replayed there.
            "small" => Llama3Config {
                dim: 192,
                n_layers: 4,
                n_heads: 6,
                n_kv_heads: 6,
                ffn_hidden: 512,
                rope_theta: 10000.0,
                rope_layout: RopeLayout::Half,
                batch: 16,
                seq_len: 128,
                ..base
            },
            // torchtitan's llama3 debug model.
            "debug" => base,
            // ../shared/peers/torch/llama_step.py's default shape.
            "peer" => Llama3Config {
                n_layers: 4,
                n_heads: 8,
                n_kv_heads: 8,
                rope_theta: 10000.0,
                rope_layout: RopeLayout::Half,
                seq_len: 256,
                ..base
            },
            "8b" => Llama3Config {
                dim: 4096,
                n_layers: 32,
                n_heads: 32,
                n_kv_heads: 8,
                vocab_size: 128256,
                ffn_hidden: 14336,
                batch: 1,
                seq_len: 8192,
                ..base
            },
            "70b" => Llama3Config {
                dim: 8192,
                n_layers: 80,
                n_heads: 64,
                n_kv_heads: 8,
                vocab_size: 128256,
                ffn_hidden: 28672,
                batch: 1,
                seq_len: 8192,
                ..base
            },
            "405b" => Llama3Config {
                dim: 16384,
                n_layers: 126,
                n_heads: 128,
                n_kv_heads: 8,
                vocab_size: 128256,
                ffn_hidden: 53248,
                batch: 1,
                seq_len: 8192,
                ..base
            },
            _ => return None,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Checks the relations between fields that the shapes rely on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("dim", self.dim),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("vocab_size", self.vocab_size),
            ("ffn_hidden", self.ffn_hidden),
            ("batch", self.batch),
            ("seq_len", self.seq_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("`{name}` must be positive"));
            }
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return Err(format!(
                "`dim` ({}) must be divisible by `n_heads` ({})",
                self.dim, self.n_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "the head dim dim/n_heads = {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "`n_heads` ({}) must be a multiple of `n_kv_heads` ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return Err(format!(
                "`rope_theta` must be positive, got {}",
                self.rope_theta
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(format!(
                "`norm_eps` must be positive, got {}",
                self.norm_eps
            ));
        }
        Ok(())
    }

    /// Parameter count (with the output head unless tied).
    pub fn num_params(&self) -> usize {
        let d = self.dim;
        let kv = self.n_kv_heads * self.head_dim();
        let attn = d * d * 2 + d * kv * 2;
        let ffn = 3 * d * self.ffn_hidden;
        let layer = attn + ffn + 2 * d;
        let emb = self.vocab_size * d;
        let head = if self.tied_embeddings { 0 } else { emb };
        emb + self.n_layers * layer + d + head
    }

    /// Training FLOPs per token by torchtitan's convention, 6(N - N_emb) + 12·L·D·T (attention
    /// counted as non-causal), so MFU figures compare with torchtitan's and the PyTorch peer's.
    pub fn flops_per_token(&self) -> f64 {
        let n_emb = self.vocab_size * self.dim;
        6.0 * (self.num_params() - n_emb) as f64
            + 12.0 * (self.n_layers * self.dim * self.seq_len) as f64
    }

    /// Traces the forward pass and the loss. Inputs `tokens` and `targets` are i32 `[batch, seq]`;
    /// the graph's output `loss` is the mean cross-entropy. The train step appends backward and
    /// the optimizer to this graph; validation runs it as it is.
    pub fn trace(&self, dtype: DType) -> Result<Traced, TypeError> {
        self.trace_with_head(dtype, Head::Loss, self.batch, self.seq_len)
    }

    /// Traces the forward pass alone for `batch` rows of `seq` tokens (at most `seq_len`: RoPE
    /// and attention are built for the shape given): input `tokens` i32 `[batch, seq]`, output
    /// `logits` `[batch, seq, vocab_size]`. Parameters have the same names, types and
    /// initializers as in `trace`, so a trained step's parameters load into it by name.
    pub fn trace_logits(
        &self,
        dtype: DType,
        batch: usize,
        seq: usize,
    ) -> Result<Traced, TypeError> {
        self.trace_with_head(dtype, Head::Logits, batch, seq)
    }

    fn trace_with_head(
        &self,
        dtype: DType,
        head: Head,
        b: usize,
        s: usize,
    ) -> Result<Traced, TypeError> {
        let d = self.dim;
        let (hq, hkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim());
        let tr = Tracer::new(match head {
            Head::Loss => "train_step",
            Head::Logits => "logits",
        });
        let t = |shape: &[usize]| TensorType::new(dtype, shape.to_vec());
        let tokens = tr.input("tokens", TensorType::new(DType::I32, [b, s]));
        let targets = match head {
            Head::Loss => Some(tr.input("targets", TensorType::new(DType::I32, [b, s]))),
            Head::Logits => None,
        };
        let init = Init::Normal { std: 0.02 };

        let emb = {
            let _m = tr.scope("tok_embeddings");
            tr.param("weight", t(&[self.vocab_size, d]), init)
        };
        let mut h = {
            let _m = tr.scope("tok_embeddings");
            emb.embedding(tokens)?
        };
        let _layers = tr.scope("layers");
        for layer in 0..self.n_layers {
            let _l = tr.scope(layer);
            let x = {
                let _m = tr.scope("attention_norm");
                let w = tr.param("weight", t(&[d]), Init::Ones);
                h.rms_norm(w, self.norm_eps)?
            };
            let attn = {
                let _m = tr.scope("attention");
                let proj = |name: &str, heads: usize| {
                    linear(&tr, name, x, t(&[heads * hd, d]))?.reshape(&[b, s, heads, hd])
                };
                let q = proj("wq", hq)?;
                let k = proj("wk", hkv)?;
                let v = proj("wv", hkv)?;
                let q = q
                    .rope(self.rope_theta, self.rope_layout)?
                    .transpose(&[0, 2, 1, 3])?;
                let k = k
                    .rope(self.rope_theta, self.rope_layout)?
                    .transpose(&[0, 2, 1, 3])?;
                let v = v.transpose(&[0, 2, 1, 3])?;
                let o = q.attention(k, v, true, 1.0 / (hd as f64).sqrt())?;
                let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[b, s, d])?;
                linear(&tr, "wo", o, t(&[d, hq * hd]))?
            };
            h = h.add(attn)?;
            let x = {
                let _m = tr.scope("ffn_norm");
                let w = tr.param("weight", t(&[d]), Init::Ones);
                h.rms_norm(w, self.norm_eps)?
            };
            let ffn = {
                let _m = tr.scope("feed_forward");
                let gate = linear(&tr, "w1", x, t(&[self.ffn_hidden, d]))?.silu()?;
                let up = linear(&tr, "w3", x, t(&[self.ffn_hidden, d]))?;
                linear(&tr, "w2", gate.mul(up)?, t(&[d, self.ffn_hidden]))?
            };
            h = h.add(ffn)?;
        }
        drop(_layers);
        let h = {
            let _m = tr.scope("norm");
            let w = tr.param("weight", t(&[d]), Init::Ones);
            h.rms_norm(w, self.norm_eps)?
        };
        let logits = {
            let _m = tr.scope("output");
            let head = if self.tied_embeddings {
                emb
            } else {
                tr.param("weight", t(&[self.vocab_size, d]), init)
            };
            h.linear(head)?
        };
        match targets {
            Some(targets) => {
                tr.set_phase(Phase::Loss);
                let logits = logits.reshape(&[b * s, self.vocab_size])?;
                let loss = logits.cross_entropy(targets.reshape(&[b * s])?)?;
                tr.output("loss", loss);
            }
            None => tr.output("logits", logits),
        }
        Ok(tr.finish())
    }
}

/// What the traced forward pass ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Head {
    /// The mean cross-entropy against `targets`.
    Loss,
    /// The logits, for sampling.
    Logits,
}

/// A bias-free linear layer in scope `name`: `x @ weightᵀ` with a new N(0, 0.02) weight
/// `[out, in]` (torch layout).
fn linear<'t>(
    tr: &'t Tracer,
    name: &str,
    x: Tensor<'t>,
    weight: TensorType,
) -> Result<Tensor<'t>, TypeError> {
    let _scope = tr.scope(name);
    let w = tr.param("weight", weight, Init::Normal { std: 0.02 });
    x.linear(w)
}
