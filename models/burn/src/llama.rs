//! A Llama-style decoder written with burn-nn, the frontend's example model: token embedding,
//! blocks of RMSNorm, attention (rotary positions, causal, burn's attention op) and a SwiGLU
//! feed-forward, each with a residual; a final RMSNorm and the output projection; mean
//! cross-entropy against the targets. Module names follow torchtitan's Llama (as graphtrain's
//! own Llama does), so name-based passes and plans find the same parts; `Linear` weights are
//! burn's `[d_in, d_out]`.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
    RotaryEncodingConfig,
};
use burn::tensor::activation::silu;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Int, Tensor};

/// The decoder's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub ffn_dim: usize,
    pub max_seq_len: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
}

#[derive(Module, Debug)]
pub struct Attention {
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
}

#[derive(Module, Debug)]
pub struct FeedForward {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

#[derive(Module, Debug)]
pub struct Block {
    pub attention_norm: RmsNorm,
    pub attention: Attention,
    pub ffn_norm: RmsNorm,
    pub feed_forward: FeedForward,
}

#[derive(Module, Debug)]
pub struct Llama {
    pub tok_embeddings: Embedding,
    pub layers: Vec<Block>,
    pub norm: RmsNorm,
    pub output: Linear,
    pub rope: RotaryEncoding,
    pub n_heads: usize,
}

fn linear(d_in: usize, d_out: usize, device: &Device) -> Linear {
    LinearConfig::new(d_in, d_out).with_bias(false).init(device)
}

impl LlamaConfig {
    /// The shape of graphtrain's Llama config `cfg`; refused for one with grouped-query heads
    /// or tied embeddings, which this model does not have.
    pub fn like(cfg: &graphtrain_models::Llama3Config) -> Result<LlamaConfig, String> {
        if cfg.n_kv_heads != cfg.n_heads || cfg.tied_embeddings {
            return Err(format!(
                "the burn example model has no grouped-query heads and no tied embeddings; \
the config has {} key/value heads for {} query heads{}",
                cfg.n_kv_heads,
                cfg.n_heads,
                if cfg.tied_embeddings {
                    ", tied embeddings"
                } else {
                    ""
                }
            ));
        }
        Ok(LlamaConfig {
            vocab_size: cfg.vocab_size,
            dim: cfg.dim,
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            ffn_dim: cfg.ffn_hidden,
            max_seq_len: cfg.seq_len,
            rope_theta: cfg.rope_theta,
            norm_eps: cfg.norm_eps,
        })
    }

    /// A model with burn's default initializers.
    pub fn init(&self, device: &Device) -> Llama {
        let norm = || {
            RmsNormConfig::new(self.dim)
                .with_epsilon(self.norm_eps)
                .init(device)
        };
        let layers = (0..self.n_layers)
            .map(|_| Block {
                attention_norm: norm(),
                attention: Attention {
                    wq: linear(self.dim, self.dim, device),
                    wk: linear(self.dim, self.dim, device),
                    wv: linear(self.dim, self.dim, device),
                    wo: linear(self.dim, self.dim, device),
                },
                ffn_norm: norm(),
                feed_forward: FeedForward {
                    w1: linear(self.dim, self.ffn_dim, device),
                    w2: linear(self.ffn_dim, self.dim, device),
                    w3: linear(self.dim, self.ffn_dim, device),
                },
            })
            .collect();
        Llama {
            tok_embeddings: EmbeddingConfig::new(self.vocab_size, self.dim).init(device),
            layers,
            norm: norm(),
            output: linear(self.dim, self.vocab_size, device),
            rope: RotaryEncodingConfig::new(self.max_seq_len, self.dim / self.n_heads)
                .with_theta(self.rope_theta as f32)
                .init(device),
            n_heads: self.n_heads,
        }
    }
}

impl Llama {
    /// Mean cross-entropy of the next-token logits of `tokens` `[batch, seq]` against
    /// `targets` `[batch, seq]`, shape `[1]`.
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [b, s] = tokens.dims();
        let mut x = self.tok_embeddings.forward(tokens);
        let dim = x.dims()[2];
        let (heads, head_dim) = (self.n_heads, dim / self.n_heads);
        for layer in &self.layers {
            let h = layer.attention_norm.forward(x.clone());
            let split = |t: Tensor<3>| t.reshape([b, s, heads, head_dim]).swap_dims(1, 2);
            let q = self
                .rope
                .forward(split(layer.attention.wq.forward(h.clone())));
            let k = self
                .rope
                .forward(split(layer.attention.wk.forward(h.clone())));
            let v = split(layer.attention.wv.forward(h));
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            let o = burn::tensor::module::attention(q, k, v, None, None, options);
            let o = o.swap_dims(1, 2).reshape([b, s, dim]);
            x = x + layer.attention.wo.forward(o);
            let h = layer.ffn_norm.forward(x.clone());
            let ff = &layer.feed_forward;
            x = x + ff
                .w2
                .forward(silu(ff.w1.forward(h.clone())) * ff.w3.forward(h));
        }
        let logits = self.output.forward(self.norm.forward(x));
        let vocab = logits.dims()[2];
        let loss = CrossEntropyLossConfig::new().init(&logits.device());
        loss.forward(logits.reshape([b * s, vocab]), targets.reshape([b * s]))
    }
}
